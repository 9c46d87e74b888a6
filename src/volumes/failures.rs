//! The last failure of each publish that did not leave a volume, so that
//! GetVolumeHealth answers for a volume whose mount failed (CSI: INACCESSIBLE
//! with that failure's message), as CSI 1.13 asks. Bounded: the oldest
//! failures go first; a publish that succeeds, or an unpublish, forgets
//! the volume's. Its mutex is a leaf, taken alone.

use std::collections::VecDeque;
use std::sync::Mutex;

use crust_protocols::sync::LockExt;

use crate::code::Code;

/// Failures kept: ids a caller can make the agent remember.
pub const MAX_FAILURES: usize = 256;

/// One publish's failure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub code: Code,
    /// Its sentence.
    pub message: String,
}

/// The failed publishes (the module doc).
#[derive(Default)]
pub(crate) struct Failures {
    list: Mutex<VecDeque<(String, Failure)>>,
}

impl Failures {
    /// Notes that the publish of `id` failed with `f`.
    pub(crate) fn note(&self, id: &str, f: Failure) {
        let mut l = self.list.locked();
        l.retain(|(i, _)| i != id);
        if l.len() >= MAX_FAILURES {
            l.pop_front();
        }
        l.push_back((id.to_string(), f));
    }

    /// Forgets `id`'s failure.
    pub(crate) fn forget(&self, id: &str) {
        self.list.locked().retain(|(i, _)| i != id);
    }

    /// The last failure of `id`'s publish, if it is kept.
    pub(crate) fn of(&self, id: &str) -> Option<Failure> {
        self.list
            .locked()
            .iter()
            .find(|(i, _)| i == id)
            .map(|(_, f)| f.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_bounded_and_the_oldest_go_first() {
        let f = Failures::default();
        let fail = |n: usize| Failure {
            code: Code::NotFound,
            message: format!("failure {n}"),
        };
        for n in 0..MAX_FAILURES + 10 {
            f.note(&format!("v{n}"), fail(n));
        }
        assert_eq!(f.list.locked().len(), MAX_FAILURES);
        assert_eq!(f.of("v0"), None);
        assert_eq!(f.of("v265"), Some(fail(265)));
        f.note("v265", fail(1));
        assert_eq!(f.of("v265"), Some(fail(1)));
        f.forget("v265");
        assert_eq!(f.of("v265"), None);
    }
}
