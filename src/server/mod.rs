//! The wire's service side: the ttrpc service `crust.v1.Agent` over the
//! volume table (`service`), and the translation it does, proto ↔ domain
//! and error → status code (`translate`). Nothing else happens here.

pub mod service;
pub mod translate;
