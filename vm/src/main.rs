//! `crust-vm`: boot the crust-agent guest under QEMU and drive its disks
//! from the command line (api.md §5); `initrd` packs the guest image.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use crust_vm::{initrd, Vm, VmOptions};

#[derive(Parser)]
#[command(
    name = "crust-vm",
    about = "Boot the crust-agent microVM and drive its disks over QMP"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the vsock backend and QEMU in the background; print the agent's address once it answers.
    Up {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value = "build/vmlinuz")]
        kernel: PathBuf,
        #[arg(long, default_value = "build/initrd.img")]
        initrd: PathBuf,
        /// Guest memory in MiB.
        #[arg(long, default_value_t = 256)]
        memory: u32,
        #[arg(long, default_value_t = 1)]
        cpus: u32,
        /// Extra kernel command line (e.g. "crust.log=debug").
        #[arg(long, default_value = "")]
        append: String,
        /// Seconds to wait for the agent.
        #[arg(long, default_value_t = 90)]
        timeout: u64,
        /// The VM's name (QEMU's -name), e.g. Kata's `sandbox-<id>`.
        #[arg(long, default_value = crust_vm::DEFAULT_NAME)]
        name: String,
    },
    /// Hot-plug a raw image as a virtio-blk disk with a serial.
    Hotplug {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        image: PathBuf,
        #[arg(long)]
        serial: String,
        #[arg(long)]
        read_only: bool,
    },
    /// Grow a hot-plugged disk's image and tell QEMU (block_resize).
    Resize {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        serial: String,
        #[arg(long)]
        bytes: u64,
    },
    /// Unplug a disk (device_del, wait for the guest, blockdev-del).
    Unplug {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        serial: String,
    },
    /// Ask the agent to shut down, then make sure QEMU and the backend have ended.
    Down {
        #[arg(long)]
        dir: PathBuf,
    },
    /// Pack the guest image: the agent as /init, the listed modules and their dependencies,
    /// and the build host's mke2fs and mkfs.xfs with their libraries.
    Initrd {
        /// The static agent binary.
        #[arg(long)]
        agent: PathBuf,
        /// The extracted kernel package (holds lib/modules/VERSION with modules.dep).
        #[arg(long)]
        kernel_root: PathBuf,
        /// The kernel release.
        #[arg(long)]
        version: String,
        /// Modules to load at boot, comma-separated (dependencies are added).
        #[arg(long, value_delimiter = ',', default_values_t = initrd::DEFAULT_MODULES.iter().map(|s| s.to_string()))]
        modules: Vec<String>,
        /// Modules to ship but not load at boot (the agent loads them on first use), comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = initrd::DEFAULT_ON_DEMAND.iter().map(|s| s.to_string()))]
        on_demand: Vec<String>,
        /// Leave out the mkfs programs (mke2fs, mkfs.xfs, their libraries and
        /// interpreter in /usr/lib/crust/mkfs/): the agent then cannot make the
        /// filesystem of a new encrypted volume.
        #[arg(long)]
        no_mkfs: bool,
        /// Write the cpio uncompressed.
        #[arg(long)]
        no_compress: bool,
        #[arg(long)]
        out: PathBuf,
    },
}

fn run(cmd: Cmd) -> crust_vm::Result<()> {
    match cmd {
        Cmd::Up {
            dir,
            kernel,
            initrd,
            memory,
            cpus,
            append,
            timeout,
            name,
        } => {
            let mut opts = VmOptions::new(dir);
            opts.name = name;
            opts.kernel = kernel;
            opts.initrd = initrd;
            opts.memory_mib = memory;
            opts.cpus = cpus;
            opts.append = append;
            opts.boot_timeout = std::time::Duration::from_secs(timeout);
            let vm = Vm::up(opts)?;
            if let Some((how, took)) = vm.readiness() {
                let how = match how {
                    crust_vm::Readiness::Notified => "READY over vsock",
                    crust_vm::Readiness::Polled => "polled",
                };
                eprintln!("agent ready after {:.1} s ({how})", took.as_secs_f64());
            }
            println!("{}", vm.address());
            vm.detach();
        }
        Cmd::Hotplug {
            dir,
            image,
            serial,
            read_only,
        } => Vm::attach(&dir)?.hotplug(&image, &serial, read_only)?,
        Cmd::Resize { dir, serial, bytes } => Vm::attach(&dir)?.resize(&serial, bytes)?,
        Cmd::Unplug { dir, serial } => Vm::attach(&dir)?.unplug(&serial)?,
        Cmd::Down { dir } => {
            let how = Vm::attach(&dir)?.down()?;
            eprintln!("{how}");
        }
        Cmd::Initrd {
            agent,
            kernel_root,
            version,
            modules,
            on_demand,
            no_mkfs,
            no_compress,
            out,
        } => {
            let spec = initrd::InitrdSpec {
                agent,
                kernel_root,
                version,
                modules,
                on_demand,
                mkfs: if no_mkfs {
                    None
                } else {
                    Some(initrd::Mkfs::from_host()?)
                },
                compress: !no_compress,
            };
            let bytes = initrd::build(&spec)?;
            std::fs::write(&out, &bytes)
                .map_err(|e| crust_vm::Error::Io(format!("cannot write {}", out.display()), e))?;
            eprintln!("{}: {} bytes", out.display(), bytes.len());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.cmd) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crust-vm: {e}");
            ExitCode::FAILURE
        }
    }
}
