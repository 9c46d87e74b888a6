//! `cdh-standin SOCKET DIR`: a stand-in for the Confidential Data Hub, run
//! inside a test guest as a service. It serves the files under DIR as KBS
//! resources on the CDH's ttrpc socket (`crust_testkit::cdh`), and says on
//! standard output each path asked and how many bytes it gave, never the
//! bytes.

use std::path::PathBuf;

use crust_testkit::cdh;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [socket, dir] = args.as_slice() else {
        eprintln!("usage: cdh-standin SOCKET DIR");
        std::process::exit(2);
    };
    let files = cdh::from_dir(PathBuf::from(dir));
    let _server = cdh::serve(socket.as_ref(), move |uri| {
        let answer = files(uri);
        match &answer {
            Ok(bytes) => println!("cdh-standin: {uri}: {} bytes", bytes.len()),
            Err((code, msg)) => println!("cdh-standin: {uri}: {code:?}: {msg}"),
        }
        answer
    });
    println!("cdh-standin: serving {dir} at {socket}");
    loop {
        std::thread::park();
    }
}
