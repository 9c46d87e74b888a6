#!/usr/bin/env python3
"""Makes the seed corpus in fuzz/corpus/ from real things, as root:

  superblock/    the probed head (PROBE_BYTES) of disks made by mkfs.ext2/3/4,
                 mkfs.xfs and mkswap with their variants (block sizes, no
                 journal, MMP, errors=panic set in the superblock or planted as
                 a default mount option, a recorded error, stale signatures)
  mountinfo/     this host's /proc/self/mountinfo, and one from a private mount
                 namespace with tmpfs mounts and binds at names the kernel
                 escapes (space, tab, newline, backslash) and that are not UTF-8
  state_record/  the state records a real crust-agent wrote for an ext4 volume
                 with an fsGroup, options and binds, and for a read-only block
                 volume with a bind
  freeze_record/ the freeze records it wrote: one thawed by its id, one ended
                 by a forced thaw
  frames/        every byte crustctl sent the agent, one file per connection,
                 recorded by a proxy in between (a first byte picks the
                 target's payload limit and read size)
  request/       each recorded request: its method's index, then its payload
  uevent/        the kernel's uevents while loop devices were attached,
                 resized and detached
  mount_options/ the option strings of this host's mounts, and the ones the
                 agent refuses
  sandbox_json/, crustd_json/  the files as crust-vm and crustd write them
  luks2_header/  the first 32 KiB (both copies of a 16 KiB header) of images
                 cryptsetup luksFormat made: PBKDF2 and Argon2 keyslots, 256-
                 and 512-bit keys, sha512, several keyslots with priorities,
                 a token, a label; and a LUKS1 header
  direct_volume/ Kata direct-volume records (mountInfo.json) as Kata's Go
                 package writes them (crustd/tests/kata_writer), and a few
                 that crustd refuses

Run from the repository root (`fuzz/seeds.py [PART...]`, every part by
default: superblock mountinfo agent mount_options crustd direct_volume
luks2_header) after `cargo build -p crust-agent -p
crust-client` (CRUST_BIN=DIR for other binaries). It makes and detaches its own loop devices only; every mount
is made in a private mount namespace and dies with it. Existing seeds of the
same name are overwritten; inputs added by hand or from findings are kept.
Needs e2fsprogs, xfsprogs, util-linux (losetup, unshare, mkswap), go,
cryptsetup.
"""

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")
BIN = os.environ.get("CRUST_BIN") or os.path.join(ROOT, "target", "x86_64-unknown-linux-gnu", "debug")
# What src/probe.rs reads of a disk (PROBE_BYTES).
PROBE_BYTES = 65536 + 4096
# The methods of crust.v1.Agent, in crust.proto's order: a request seed starts with its
# method's index here, as the request target picks it from crust_agent::server::methods::METHODS
# (a test of src/fuzz.rs holds the two lists to one).
METHODS = [
    "GetCapabilities", "GetSupportedFileSystems", "PublishVolume", "UnpublishVolume",
    "GetVolumeStats", "ExpandVolume", "BindMount", "Unmount", "ListVolumes",
    "GetAgentInfo", "Shutdown", "FreezeVolumes", "ThawVolumes", "TrimVolume",
    "GetVolumeHealth",
]
NETLINK_KOBJECT_UEVENT = 15


def run(*args, **kw):
    return subprocess.run(args, check=True, capture_output=True, **kw).stdout


def seed(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- superblocks ----

def superblocks(tmp):
    def disk(name, mb, mkfs, after=None, tail=None):
        img = os.path.join(tmp, name + ".img")
        with open(img, "wb") as f:
            f.truncate(mb << 20)
        try:
            run(*mkfs, img)
        except subprocess.CalledProcessError as e:
            print("superblock %s skipped: %s" % (name, e.stderr.decode().strip()))
            return
        if after:
            after(img)
        with open(img, "rb") as f:
            head = f.read(PROBE_BYTES)
            # The target reads bytes past the head as the block the
            # superblock names for MMP.
            seed("superblock", name, head + (tail(f, head) if tail else b""))
        os.unlink(img)

    def mmp_block(f, head):
        sb = head[1024:2048]
        block = struct.unpack_from("<Q", sb, 0x168)[0] * (1024 << struct.unpack_from("<I", sb, 0x18)[0])
        f.seek(block)
        return f.read(1024)

    def mmp_busy(img):
        # A live sequence and a 10-minute check interval: the kernel would
        # sleep in mount(2) for twenty minutes.
        with open(img, "r+b") as f:
            head = f.read(PROBE_BYTES)
            sb = head[1024:2048]
            at = struct.unpack_from("<Q", sb, 0x168)[0] * (1024 << struct.unpack_from("<I", sb, 0x18)[0])
            f.seek(at + 4)
            f.write(struct.pack("<I", 0x12345678))
            f.seek(at + 0x70)
            f.write(struct.pack("<H", 600))

    def debugfs(*cmds):
        return lambda img: [run("debugfs", "-w", "-R", c, img) for c in cmds]

    def stale_xfs(img):
        with open(img, "r+b") as f:
            f.write(b"XFSB")

    ext4 = ["mkfs.ext4", "-q", "-F"]
    disk("ext4", 64, ext4)
    disk("ext4-1k-blocks", 64, ext4 + ["-b", "1024"])
    disk("ext4-no-journal", 64, ext4 + ["-O", "^has_journal"])
    disk("ext4-32bit", 64, ext4 + ["-O", "^64bit"])
    disk("ext4-mmp", 64, ext4 + ["-O", "mmp"], tail=mmp_block)
    disk("ext4-mmp-busy", 64, ext4 + ["-O", "mmp"], mmp_busy, tail=mmp_block)
    disk("ext4-journal-device", 64, ext4 + ["-O", "journal_dev"])
    disk("ext4-bigalloc", 64, ext4 + ["-O", "bigalloc", "-C", "65536"])
    disk("ext4-errors-panic", 64, ext4 + ["-e", "panic"])
    disk("ext4-planted-errors-panic", 64, ext4,
         lambda img: run("tune2fs", "-E", "mount_opts=errors=panic", img))
    disk("ext4-recorded-errors", 64, ext4, debugfs("ssv state 2", "ssv error_count 7"))
    disk("ext4-stale-xfs", 64, ext4, stale_xfs)
    disk("ext3", 64, ["mkfs.ext3", "-q", "-F"])
    disk("ext2", 64, ["mkfs.ext2", "-q", "-F"])
    # mkfs.xfs wants 300 MiB at least; the images are sparse.
    xfs = ["mkfs.xfs", "-q", "-f"]
    disk("xfs", 320, xfs)
    disk("xfs-1k-blocks", 320, xfs + ["-b", "size=1024"])
    disk("xfs-4k-sectors", 320, xfs + ["-s", "size=4096"])
    disk("xfs-v4", 320, xfs + ["-m", "crc=0"])
    for name, opt in (("xfs-external-log", "-l"), ("xfs-realtime", "-r")):
        dev = os.path.join(tmp, name + ".dev")
        with open(dev, "wb") as f:
            f.truncate(64 << 20)
        key = "logdev" if opt == "-l" else "rtdev"
        disk(name, 320, xfs + [opt, "%s=%s" % (key, dev)])
        os.unlink(dev)
    disk("swap", 64, ["mkswap", "-q"])
    seed("superblock", "blank", bytes(PROBE_BYTES))
    # A disk shorter than the probe: the superblock cut off.
    with open(os.path.join(CORPUS, "superblock", "ext4"), "rb") as f:
        seed("superblock", "ext4-truncated", f.read(1100))


# ---- mountinfo ----

AWKWARD = [b"plain", b"with space", b"with\ttab", b"with\nnewline", b"back\\slash",
           b"not-utf8-\xff\xfe", b"deep/er/still"]

NAMESPACE_SCRIPT = r"""
import os, subprocess, sys
base = sys.argv[1].encode()
names = eval(sys.argv[2])
for n in names:
    p = os.path.join(base, n)
    os.makedirs(p)
    subprocess.run([b"mount", b"-t", b"tmpfs", b"-o", b"size=1m,mode=0755", b"tmpfs", p], check=True)
    os.makedirs(os.path.join(p, b"sub"))
first = os.path.join(base, names[0])
for n in names[1:3]:
    subprocess.run([b"mount", b"--bind", os.path.join(first, b"sub"), os.path.join(base, n, b"sub")], check=True)
subprocess.run([b"mount", b"-o", b"remount,ro,bind", os.path.join(base, names[1], b"sub")], check=True)
sys.stdout.buffer.write(open("/proc/self/mountinfo", "rb").read())
"""


def mountinfo(tmp):
    with open("/proc/self/mountinfo", "rb") as f:
        seed("mountinfo", "host", f.read())
    base = os.path.join(tmp, "mounts")
    os.makedirs(base)
    out = run("unshare", "-m", "--propagation", "private", sys.executable, "-c",
              NAMESPACE_SCRIPT, base, repr(AWKWARD))
    seed("mountinfo", "escaped-names", out)
    # The same table cut to the lines under the awkward mounts alone.
    mine = b"".join(l + b"\n" for l in out.split(b"\n") if base.encode() in l)
    seed("mountinfo", "escaped-names-only", mine)


# ---- uevents ----

class Uevents:
    """Records every kernel uevent (netlink group 1) until stopped."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT)
        self.sock.bind((0, 1))
        self.sock.settimeout(0.2)
        self.events = []
        self.stop = False
        self.thread = threading.Thread(target=self.loop)
        self.thread.start()

    def loop(self):
        while not self.stop:
            try:
                self.events.append(self.sock.recv(65536))
            except socket.timeout:
                pass

    def finish(self, loops):
        time.sleep(0.5)
        self.stop = True
        self.thread.join()
        names = [os.path.basename(l).encode() for l in loops]
        kept = 0
        for ev in self.events:
            fields = dict(kv.split(b"=", 1) for kv in ev.split(b"\0")[1:] if b"=" in kv)
            if fields.get(b"DEVNAME") in names or fields.get(b"SUBSYSTEM") == b"bdi":
                action = fields.get(b"ACTION", b"none").decode()
                seed("uevent", "%02d-%s-%s" % (kept, action, fields.get(b"SUBSYSTEM", b"").decode()), ev)
                kept += 1
        # A loop device's own events are changes; a hot-plugged disk's are
        # add and remove, and a partition's carry DEVTYPE=partition.
        if self.events:
            disk = next((e for e in self.events if b"DEVTYPE=disk" in e), self.events[0])
            for action in (b"add", b"remove"):
                seed("uevent", "disk-" + action.decode(),
                     disk.replace(b"change@", action + b"@").replace(b"ACTION=change", b"ACTION=" + action))
            seed("uevent", "partition-add",
                 disk.replace(b"change@", b"add@").replace(b"ACTION=change", b"ACTION=add")
                 .replace(b"DEVTYPE=disk", b"DEVTYPE=partition\0PARTN=1"))
        # What udev rebroadcasts (group 2): not a kernel event, ignored.
        seed("uevent", "libudev", b"libudev\0\xfe\xed\xca\xfe" + bytes(32) + b"ACTION=add\0")


# ---- frames, requests and state records, from a real agent ----

class Proxy:
    """Relays unix-socket connections to the agent, recording what clients send."""

    def __init__(self, listen, agent):
        self.agent = agent
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(listen)
        self.srv.listen(8)
        self.streams = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            c, _ = self.srv.accept()
            a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            a.connect(self.agent)
            rec = bytearray()
            self.streams.append(rec)
            threading.Thread(target=self.pipe, args=(c, a, rec), daemon=True).start()
            threading.Thread(target=self.pipe, args=(a, c, None), daemon=True).start()

    @staticmethod
    def pipe(src, dst, rec):
        while True:
            try:
                b = src.recv(65536)
            except OSError:
                b = b""
            if not b:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            if rec is not None:
                rec.extend(b)
            dst.sendall(b)


def varint(b, i):
    v = s = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return v, i


def envelope(body):
    """The method and payload of a ttrpc Request (fields 2 and 3)."""
    i, fields = 0, {}
    while i < len(body):
        key, i = varint(body, i)
        if key & 7 == 2:
            n, i = varint(body, i)
            fields[key >> 3] = body[i:i + n]
            i += n
        else:
            _, i = varint(body, i)
    return fields.get(2, b"").decode(), fields.get(3, b"")


def record_agent(tmp):
    loops = []
    events = Uevents()
    try:
        src = os.path.join(tmp, "content")
        os.makedirs(os.path.join(src, "data", "deeper"))
        with open(os.path.join(src, "data", "file"), "w") as f:
            f.write("hello\n")
        fs_img, blk_img = os.path.join(tmp, "fs.img"), os.path.join(tmp, "blk.img")
        for img, mb in ((fs_img, 64), (blk_img, 16)):
            with open(img, "wb") as f:
                f.truncate(mb << 20)
        run("mkfs.ext4", "-q", "-F", "-d", src, fs_img)
        for img in (fs_img, blk_img):
            loops.append(run("losetup", "-f", "--show", img).decode().strip())
        fs_dev, blk_dev = loops

        # The guest's root, /run/crust, on a tmpfs over /run that only the
        # agent's private mount namespace sees.
        root = "/run/crust"
        agent_sock, proxy_sock = os.path.join(tmp, "agent.sock"), os.path.join(tmp, "proxy.sock")
        agent = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             'mount -t tmpfs -o mode=0755 tmpfs /run && exec "$0" --listen "unix://$1" --root "$2"',
             os.path.join(BIN, "crust-agent"), agent_sock, root],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            if os.path.exists(agent_sock):
                break
            time.sleep(0.1)
        proxy = Proxy(proxy_sock, agent_sock)
        env = dict(os.environ, CRUST_ADDR="unix://" + proxy_sock)

        def ctl(*args):
            subprocess.run([os.path.join(BIN, "crustctl"), *args], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        ctl("capabilities")
        ctl("filesystems")
        ctl("info")
        ctl("publish", "vol-1", "--device", fs_dev, "--fs-type", "ext4", "-o", "noatime,nodev",
            "-o", "errors=remount-ro", "--fs-group", "2000", "--fs-group-policy", "on-root-mismatch")
        ctl("bind", "vol-1", root + "/pods/p1/data", "--subpath", "data")
        ctl("bind", "vol-1", root + "/pods/p1/ro", "--subpath", "data/deeper", "--read-only",
            "--recursive-read-only", "if-possible")
        ctl("publish", "blk-1", "--device", blk_dev, "--block", "--read-only")
        ctl("bind", "blk-1", root + "/pods/p1/dev")
        ctl("stats", "vol-1")
        ctl("stats", "blk-1")
        ctl("list")
        # unshare and sh exec the agent: its pid is ours to look through.
        state = "/proc/%d/root%s/state" % (agent.pid, root)
        for name in os.listdir(state):
            if name.endswith(".vol"):
                with open(os.path.join(state, name), "rb") as f:
                    seed("state_record", name, f.read())
        # A resize the kernel announces (change, RESIZE=1); the expand itself
        # may fail on a host without CAP_SYS_RESOURCE: its request is what counts.
        with open(fs_img, "r+b") as f:
            f.truncate(96 << 20)
        run("losetup", "-c", fs_dev)
        ctl("expand", "vol-1", "--wait", "2")
        ctl("publish", "bad id", "--serial", "vol-0123456789abcdef", "--fs-type", "xfs", "--wait", "1")
        ctl("bind", "vol-1", "/etc", "--read-only", "--recursive-read-only", "enabled")
        ctl("unmount", root + "/pods/p1/ro")
        # Freezes as leases: a caller's id, its thaw, a forced thaw, and
        # the requests refused; then trim and health.
        ctl("freeze", "vol-1", "--thaw-after", "30", "--freeze-id", "seed:backup.1")
        ctl("thaw", "seed:backup.1")
        ctl("freeze", "vol-1", "--freeze-id", "seed:backup.2")
        ctl("thaw", "--force", "vol-1", "blk-1")
        ctl("thaw", "seed:never")
        ctl("freeze", "vol-1", "blk-1", "--freeze-id", "-bad")
        ctl("trim", "vol-1", "--min-extent", "64K")
        ctl("health", "vol-1")
        for name in os.listdir(state + "/freezes"):
            if name.endswith(".freeze"):
                with open(os.path.join(state, "freezes", name), "rb") as f:
                    seed("freeze_record", name, f.read())
        ctl("unpublish", "blk-1")
        ctl("unpublish", "vol-1")
        ctl("shutdown")
        agent.wait(timeout=30)
        time.sleep(0.2)

        for n, stream in enumerate(proxy.streams):
            stream = bytes(stream)
            # 0xfd: the agent's own 64 KiB limit, read in pieces of 32 bytes.
            seed("frames", "conn-%02d" % n, b"\xfd" + stream)
            i = 0
            while i + 10 <= len(stream):
                length = struct.unpack(">I", stream[i:i + 4])[0]
                method, payload = envelope(stream[i + 10:i + 10 + length])
                if method in METHODS:
                    seed("request", "%02d-%s" % (n, method), bytes([METHODS.index(method)]) + payload)
                i += 10 + length
        # The first connection again with a 16-byte limit, read a byte at a time.
        if proxy.streams:
            seed("frames", "small-limit", b"\x02" + bytes(proxy.streams[0]))
    finally:
        for dev in loops:
            subprocess.run(["losetup", "-d", dev])
        events.finish(loops)


# ---- option strings ----

def mount_options():
    seen = set()
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            pre, _, post = line.partition(b" - ")
            for opts in (pre.split(b" ")[5], post.split(b" ")[2].strip()):
                seen.add(opts)
    for n, opts in enumerate(sorted(seen)):
        seed("mount_options", "host-%02d" % n, b"\0" + opts)
    for name, opts in [
        ("ro-noatime", b"\x01noatime\nnosuid,nodev"),
        ("data", b"\0discard,nouuid\ndata=ordered\nerrors=remount-ro"),
        ("defaults", b"\0defaults"),
        ("errors-panic", b"\0noatime,errors=panic"),
        ("bind", b"\0bind"),
        ("loop", b"\0loop=/dev/loop0"),
        ("empty-item", b"\0noatime,,nosuid"),
        ("nul", b"\0disc\0ard"),
        # kubelet's SELinux context option (KEP-1710), quoted for its commas;
        # the first byte's second bit says whether the guest has SELinux.
        ("selinux-context", b'\0context="system_u:object_r:container_file_t:s0:c1,c2"'),
        ("selinux-context-kept", b'\2context="system_u:object_r:container_file_t:s0:c1,c2"'),
        ("selinux-mixed", b'\0noatime,fscontext="a:b:c:s0",nodev\ndefcontext=x\nro'),
    ]:
        seed("mount_options", name, opts)


# ---- crustd's files ----

def crustd_files():
    d = "/run/crust/sandboxes/pod-1"
    seed("sandbox_json", "crust-vm", json.dumps(
        {"qmp": d + "/qmp.sock", "agent": "hvsock://%s/vsock.sock:1024" % d}).encode())
    seed("sandbox_json", "relative-unix", json.dumps(
        {"qmp": "qmp.sock", "agent": "unix:///run/agent.sock", "extra": [1, {"x": None}]}).encode())
    seed("sandbox_json", "vsock", json.dumps({"qmp": "/q", "agent": "vsock://3:1024"}).encode())
    vol = {
        "volume_id": "crustd-0123456789abcdef", "serial": "crust-0123456789abcdef",
        "node": "crust-node-0123456789abcdef", "device": "crust-dev-0123456789abcdef",
        "rdev": "7:3", "host_target_path": "/var/lib/kubelet/pods/p/volumes/v",
        "guest_path": "/run/crust/volumes/crustd-0123456789abcdef", "file_system": "ext4",
        "read_only": False, "block": False, "phase": "published",
    }
    blk = dict(vol, volume_id="crustd-fedcba9876543210", rdev="259:1", file_system="",
               guest_path="", block=True, read_only=True, phase="plugging")
    # serde_json's to_vec_pretty: two-space indentation, fields in order.
    seed("crustd_json", "two-volumes", json.dumps(
        {"volumes": {"/dev/loop3": vol, "pvc-blk": blk}}, indent=2).encode())
    seed("crustd_json", "empty", b'{\n  "volumes": {}\n}')


# ---- Kata direct-volume records ----

def direct_volumes(tmp):
    root = os.path.join(tmp, "direct")
    writer = os.path.join(ROOT, "crustd", "tests", "kata_writer", "main.go")
    records = [
        ("plain", ["/dev/sdx", "ext4"]),
        ("fsgroup-options", ["/dev/disk/by-id/virtio-vol-1", "ext4", "fsGroup=2000",
                             "fsGroupChangePolicy=OnRootMismatch", "-o", "noatime", "-o", "discard"]),
        ("xfs-create", ["/dev/sdy", "xfs", "createFilesystem=true"]),
        ("block-type", ["/dev/sdz", "ext4", "volume-type=block"]),
        ("encrypted", ["/dev/sdx", "ext4", "encryptionKey=kbs:///default/key/1"]),
        # Go escapes <, > and & in strings (\u003c): a device path with them.
        ("go-escapes", ["/dev/disk/by-path/a<b>&c", "ext4", "fsGroup=0"]),
    ]
    for n, (name, args) in enumerate(records):
        volume = "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pv-%d/mount" % n
        run("go", "run", writer, "add", root, volume, *args)
        enc = base64.urlsafe_b64encode(volume.encode()).decode()
        with open(os.path.join(root, enc, "mountInfo.json"), "rb") as f:
            seed("direct_volume", name, f.read())
    for name, raw in [
        ("duplicate-key", b'{"volume-type":"directvol","device":"/dev/a","device":"/dev/b","fstype":"ext4"}'),
        ("case-variant-key", b'{"volume-type":"directvol","DEVICE":"/dev/a","fstype":"ext4"}'),
        ("unknown-keys-and-nulls", b'{"volume-type":"directvol","device":"/dev/a","fstype":"xfs",'
                                   b'"metadata":null,"options":null,"azure":{"x":[1,2]}}'),
        ("refused-option", b'{"volume-type":"directvol","device":"/dev/a","fstype":"ext4",'
                           b'"options":["errors=panic"]}'),
    ]:
        seed("direct_volume", name, raw)


# ---- LUKS2 headers ----

# The passphrase of every seed (crust_agent::luks2::fuzz::PASSPHRASE).
LUKS_PASSPHRASE = b"crust"


def luks2_headers(tmp):
    key = os.path.join(tmp, "luks-key")
    with open(key, "wb") as f:
        f.write(LUKS_PASSPHRASE)
    fast = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    argon = ["--pbkdf", "argon2id", "--pbkdf-memory", "32768", "--pbkdf-force-iterations", "4"]

    def image(name, args, after=(), keep=32768, kind="luks2"):
        img = os.path.join(tmp, name + ".img")
        with open(img, "wb") as f:
            f.truncate(32 << 20)
        small = ["--luks2-metadata-size", "16k"] if kind == "luks2" else []
        run("cryptsetup", "luksFormat", "--type", kind, "--batch-mode", "--key-file", key,
            *small, *args, img)
        for cmd in after:
            run("cryptsetup", *[a.replace("IMG", img).replace("KEY", key) for a in cmd])
        with open(img, "rb") as f:
            seed("luks2_header", name, f.read(keep))

    image("pbkdf2-sha256", fast)
    image("pbkdf2-sha512-256bit", fast + ["--hash", "sha512", "--key-size", "256"])
    image("argon2id", argon)
    image("argon2i-sector-512", ["--pbkdf", "argon2i", "--pbkdf-memory", "32768",
                                 "--pbkdf-force-iterations", "4", "--sector-size", "512"])
    image("label-subsystem", fast + ["--label", "pvc-1", "--subsystem", "crust"])
    token = os.path.join(tmp, "token.json")
    with open(token, "w") as f:
        f.write('{"type":"crust-test","keyslots":["0"],"x":[1,2.5,{"y":null}],"s":"\\u00e9\\/"}')
    image("keyslots-priorities-token", fast, after=[
        ["luksAddKey", "--batch-mode", "--key-file", "KEY", *fast, "--key-slot", "3", "IMG", "KEY"],
        ["luksAddKey", "--batch-mode", "--key-file", "KEY", *argon, "--key-slot", "5", "IMG", "KEY"],
        ["config", "--priority", "prefer", "--key-slot", "3", "IMG"],
        ["config", "--priority", "ignore", "--key-slot", "0", "IMG"],
        ["token", "import", "--json-file", token, "IMG"],
    ])
    image("luks1", ["--pbkdf-force-iterations", "1000"], keep=4096, kind="luks1")


def main():
    if os.geteuid() != 0:
        sys.exit("seeds.py makes loop devices and mounts: run it as root")
    parts = {
        "superblock": superblocks,
        "mountinfo": mountinfo,
        "agent": record_agent,  # frames, request, state_record, freeze_record, uevent
        "mount_options": lambda tmp: mount_options(),
        "crustd": lambda tmp: crustd_files(),  # sandbox_json, crustd_json
        "direct_volume": direct_volumes,
        "luks2_header": luks2_headers,
    }
    wanted = sys.argv[1:] or list(parts)
    unknown = [w for w in wanted if w not in parts]
    if unknown:
        sys.exit("unknown parts %s; choose from %s" % (unknown, " ".join(parts)))
    tmp = tempfile.mkdtemp(prefix="crust-seeds.")
    try:
        for w in wanted:
            parts[w](tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for t in sorted(os.listdir(CORPUS)):
        print("%-14s %d inputs" % (t, len(os.listdir(os.path.join(CORPUS, t)))))


if __name__ == "__main__":
    main()
