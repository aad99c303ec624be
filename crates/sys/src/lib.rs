pub mod probe;
pub mod uapi;
