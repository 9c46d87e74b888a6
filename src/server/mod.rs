//! The wire's service side: the one list of the ttrpc service
//! `crust.v1.Agent`'s methods and what is made from it (`methods`), each
//! method's work over the volume table (`service`, asking the table through
//! `volumes`), and the translation it does, proto ↔ domain and error →
//! status code (`translate`). Nothing else happens here.

pub mod methods;
pub mod service;
pub mod translate;
pub mod volumes;
