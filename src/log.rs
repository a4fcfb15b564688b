//! Messages on stderr for a person finding out what happened: `RBR_LOG=error|warn|info|debug`
//! (each level includes those before it). Unset or `off`: the library prints nothing.
//! Connection events and failures name the peer (its address over verbs, its process over
//! shm); nothing is logged per message.

use std::io::Write;
use std::sync::OnceLock;

/// How much to say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Error = 1,
    Warn,
    Info,
    #[allow(dead_code)]
    Debug,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
        }
    }
}

/// The level `RBR_LOG` asks for (0: nothing), read once.
fn threshold() -> u8 {
    static LEVEL: OnceLock<u8> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let v = std::env::var("RBR_LOG").unwrap_or_default();
        match v.to_ascii_lowercase().as_str() {
            "" | "off" | "0" => 0,
            "error" => Level::Error as u8,
            "warn" => Level::Warn as u8,
            "info" => Level::Info as u8,
            "debug" => Level::Debug as u8,
            _ => {
                // Said once, whatever level: the user asked for logging and got the name wrong.
                let _ = writeln!(
                    std::io::stderr().lock(),
                    "rdmabridge: RBR_LOG={v:?} is not off, error, warn, info or debug; logging stays off"
                );
                0
            }
        }
    })
}

/// Whether messages of `level` are printed.
pub(crate) fn enabled(level: Level) -> bool {
    level as u8 <= threshold()
}

/// Prints one line (use `log!`, which checks the level before formatting).
pub(crate) fn write(level: Level, args: std::fmt::Arguments<'_>) {
    let _ = writeln!(
        std::io::stderr().lock(),
        "rdmabridge[{}] {}: {args}",
        std::process::id(),
        level.name()
    );
}

/// `log!(Info, "connected to {addr}")`: one line on stderr when `RBR_LOG` asks for the level.
macro_rules! log {
    ($level:ident, $($arg:tt)*) => {
        if $crate::log::enabled($crate::log::Level::$level) {
            $crate::log::write($crate::log::Level::$level, format_args!($($arg)*))
        }
    };
}

pub(crate) use log;
