// An independent ttrpc client — Go's containerd/ttrpc, as a runtime's shim
// would use — against crust-agent, for tests/interop.rs. Messages are
// encoded by hand (rawMsg), so no generated Go code is needed.
//
// usage: go_client SOCKET
package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/containerd/ttrpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// rawMsg is a protobuf message whose bytes are given (gogo's Marshaler).
type rawMsg struct{ b []byte }

func (m *rawMsg) Reset()                   { m.b = nil }
func (m *rawMsg) String() string           { return fmt.Sprintf("%x", m.b) }
func (*rawMsg) ProtoMessage()              {}
func (m *rawMsg) Marshal() ([]byte, error) { return m.b, nil }
func (m *rawMsg) Unmarshal(b []byte) error { m.b = append([]byte(nil), b...); return nil }

func str(field byte, s string) []byte {
	return append([]byte{field<<3 | 2, byte(len(s))}, s...)
}

func fail(format string, a ...interface{}) {
	fmt.Printf("FAIL: "+format+"\n", a...)
	os.Exit(1)
}

func main() {
	conn, err := net.Dial("unix", os.Args[1])
	if err != nil {
		fail("dial: %v", err)
	}
	c := ttrpc.NewClient(conn)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var resp rawMsg
	for i := 0; i < 100; i++ {
		if err := c.Call(ctx, "crust.v1.Agent", "GetCapabilities", &rawMsg{}, &resp); err != nil {
			fail("GetCapabilities: %v", err)
		}
	}
	if len(resp.b) == 0 {
		fail("GetCapabilities answered no capabilities")
	}
	if err := c.Call(ctx, "crust.v1.Agent", "Frobnicate", &rawMsg{}, &resp); status.Code(err) != codes.Unimplemented {
		fail("an unknown method: %v, want Unimplemented", err)
	}
	if err := c.Call(ctx, "crust.v1.Agent", "PublishVolume", &rawMsg{}, &resp); status.Code(err) != codes.InvalidArgument {
		fail("a publish without a volume id: %v, want InvalidArgument", err)
	}
	// Not protobuf at all (a length running past the end): InvalidArgument, not silence.
	if err := c.Call(ctx, "crust.v1.Agent", "PublishVolume", &rawMsg{b: []byte{0x0a, 0x10, 'a'}}, &resp); status.Code(err) != codes.InvalidArgument {
		fail("a payload that is not protobuf: %v, want InvalidArgument", err)
	}

	// The caller's deadline is the request's: a publish waiting 60 s for a
	// disk that never comes ends with the Go client's 300 ms deadline.
	pub := append(append(str(1, "go-vol"), str(2, "never-there")...), str(4, "ext4")...)
	pub = append(pub, 0x40, 0xe0, 0xd4, 0x03) // timeout_ms = 60000
	short, cancelShort := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancelShort()
	start := time.Now()
	err = c.Call(short, "crust.v1.Agent", "PublishVolume", &rawMsg{b: pub}, &resp)
	if !errors.Is(err, context.DeadlineExceeded) && status.Code(err) != codes.DeadlineExceeded {
		fail("a publish past the deadline: %v, want DeadlineExceeded", err)
	}
	if time.Since(start) > 2*time.Second {
		fail("the deadline took %v", time.Since(start))
	}

	// Many calls at once on one connection.
	done := make(chan error, 64)
	for i := 0; i < 64; i++ {
		go func() {
			var r rawMsg
			done <- c.Call(ctx, "crust.v1.Agent", "GetAgentInfo", &rawMsg{}, &r)
		}()
	}
	for i := 0; i < 64; i++ {
		if err := <-done; err != nil {
			fail("concurrent GetAgentInfo: %v", err)
		}
	}
	fmt.Println("ok")
}
