//! The async API (feature `tokio`) over shm: the tests of tests/common/asyncs.rs.

#![cfg(feature = "tokio")]

mod common;

use common::Net;

macro_rules! async_over_shm {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            common::asyncs::$name(&Net::Shm);
        }
    )*};
}

common::asyncs::for_each_async_test!(async_over_shm);
