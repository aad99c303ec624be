pub mod uapi;
