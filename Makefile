# crust-agent: build, test, initrd, demo, bench. Every target installs what it needs.
.PHONY: build test initrd test-vm
build:
	cargo build --release
test:
	cargo test --workspace
initrd:
	initrd/build.sh
# Boots the guest under QEMU (needs `make initrd` output).
test-vm: initrd
	command -v vhost-device-vsock >/dev/null || [ -x $$HOME/.cargo/bin/vhost-device-vsock ] || cargo install vhost-device-vsock --locked
	command -v qemu-system-x86_64 >/dev/null || apt-get install -y qemu-system-x86
	cargo test -p crust-vm --test boot -- --ignored --nocapture --test-threads=1
