//! A stand-in for the Confidential Data Hub: the CDH's own ttrpc service
//! (`/api.GetResourceService/GetResource`, from the stubs generated from
//! protocols/cdh.proto, so the method's path and the messages' encoding are
//! the CDH's) served by the ttrpc crate on a unix socket, answering what
//! the test chooses. The agent's key tests serve one in a temporary
//! directory; the `cdh-standin` program serves a directory's files from
//! inside a guest, as a CDH serves what its KBS released.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crust_protocols::cdh::{GetResourceRequest, GetResourceResponse};
use crust_protocols::cdh_ttrpc::{create_get_resource_service, GetResourceService};
use crust_protocols::ttrpc::{self, TtrpcContext};

/// The answer for one resource path: its bytes, or the CDH's refusal.
pub type Answer = Result<Vec<u8>, (ttrpc::Code, String)>;

struct StandIn<F>(F);

impl<F: Fn(&str) -> Answer> GetResourceService for StandIn<F> {
    fn get_resource(
        &self,
        _: &TtrpcContext,
        req: GetResourceRequest,
    ) -> ttrpc::Result<GetResourceResponse> {
        match (self.0)(&req.ResourcePath) {
            Ok(resource) => {
                let mut r = GetResourceResponse::new();
                r.Resource = resource;
                Ok(r)
            }
            Err((code, msg)) => Err(ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg))),
        }
    }
}

/// A stand-in answering with `answer`, listening on `socket` (its directory
/// made, a stale socket there replaced) until it is shut down.
pub fn serve(
    socket: &Path,
    answer: impl Fn(&str) -> Answer + Send + Sync + 'static,
) -> ttrpc::Server {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).unwrap();
    }
    if let Err(e) = std::fs::remove_file(socket) {
        assert!(e.kind() == ErrorKind::NotFound, "{}: {e}", socket.display());
    }
    let mut server = ttrpc::Server::new()
        .bind(&format!("unix://{}", socket.display()))
        .unwrap_or_else(|e| panic!("{}: {e}", socket.display()))
        .register_service(create_get_resource_service(Arc::new(StandIn(answer))));
    server.start().unwrap();
    server
}

/// The `cdh-standin` program (src/bin/cdh_standin.rs) of this build, built
/// once per test process.
pub fn program() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            crate::build::cargo_build("crust-testkit", &["--bin", "cdh-standin"]);
            crate::build::profile_dir().join("cdh-standin")
        })
        .clone()
}

/// Answers from the files under `dir`, as a KBS's resource plugin names
/// them: `kbs:///repository/type/tag` is the file `dir/repository/type/tag`.
/// A path of another shape is INVALID_ARGUMENT; a missing file NOT_FOUND;
/// any other failure INTERNAL, the code the CDH gives every KBS failure.
pub fn from_dir(dir: PathBuf) -> impl Fn(&str) -> Answer + Send + Sync + 'static {
    move |uri| {
        let Some(rel) = resource_path(uri) else {
            return Err((
                ttrpc::Code::INVALID_ARGUMENT,
                format!("{uri:?} is not kbs:///repository/type/tag"),
            ));
        };
        std::fs::read(dir.join(&rel)).map_err(|e| match e.kind() {
            ErrorKind::NotFound => (ttrpc::Code::NOT_FOUND, format!("no resource {rel}")),
            _ => (ttrpc::Code::INTERNAL, format!("resource {rel}: {e}")),
        })
    }
}

/// `repository/type/tag` of `kbs:///repository/type/tag`, each segment as
/// the KBS takes one (`[A-Za-z0-9_-][A-Za-z0-9_.-]*`): no `..`, no way out
/// of the directory.
fn resource_path(uri: &str) -> Option<String> {
    let rel = uri.strip_prefix("kbs:///")?;
    let segments: Vec<&str> = rel.split('/').collect();
    let good = |s: &&str| {
        let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
        s.chars().next().is_some_and(ok) && s.chars().all(|c| ok(c) || c == '.')
    };
    (segments.len() == 3 && segments.iter().all(good)).then(|| rel.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_paths_stay_in_the_directory() {
        assert_eq!(
            resource_path("kbs:///default/key/vol").as_deref(),
            Some("default/key/vol")
        );
        for bad in [
            "kbs:///default/key",
            "kbs:///a/b/c/d",
            "kbs:///../key/vol",
            "kbs:///default/.key/vol",
            "kbs:///default//vol",
            "kbs://host/default/key/vol",
            "file:///default/key/vol",
        ] {
            assert_eq!(resource_path(bad), None, "{bad}");
        }
    }

    #[test]
    fn files_are_served_and_missing_ones_are_not_found() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("default/key")).unwrap();
        std::fs::write(dir.path().join("default/key/vol"), b"k\0\n").unwrap();
        let answer = from_dir(dir.path().to_path_buf());
        assert_eq!(answer("kbs:///default/key/vol").unwrap(), b"k\0\n");
        assert_eq!(
            answer("kbs:///default/key/missing").unwrap_err().0,
            ttrpc::Code::NOT_FOUND
        );
        assert_eq!(
            answer("kbs:///default/key").unwrap_err().0,
            ttrpc::Code::INVALID_ARGUMENT
        );
    }
}
