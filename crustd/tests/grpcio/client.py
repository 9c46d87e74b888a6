"""A gRPC client on Python's grpcio (gRPC C-core), for crustd/tests/grpcio.rs.

usage: client.py SOCKET AUTHORITY < calls.json
  AUTHORITY "-": a default channel (C-core sends the socket's path,
  percent-encoded, as :authority); anything else is sent as :authority
  (the socket's path plainly is what grpc-java and grpcurl send).
calls.json: [{"method": "/pkg.Service/Method", "request": "<hex>"}, ...]
prints: [{"code": "OK", "response": "<hex>"} | {"code": "NAME", "details": "..."}]

Messages travel as bytes; the Rust test encodes and decodes them from the
.proto, so this side is only the transport under test.
"""
import json
import sys

import grpc


def main():
    sock, authority = sys.argv[1], sys.argv[2]
    options = [] if authority == "-" else [("grpc.default_authority", authority)]
    channel = grpc.insecure_channel("unix://" + sock, options=options)
    out = []
    for call in json.load(sys.stdin):
        method = channel.unary_unary(call["method"])
        try:
            response = method(bytes.fromhex(call["request"]), timeout=60)
            out.append({"code": "OK", "response": response.hex()})
        except grpc.RpcError as e:
            out.append({"code": e.code().name, "details": e.details()})
    channel.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
