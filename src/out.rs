//! Standard output for every command, in one place: a reader that goes away (`tern job list
//! --json | head -2`) ends the command quietly, with status 0, instead of a panic. Commands
//! print with [`outln!`]; errors whose cause is a closed stdout are told apart by
//! [`is_broken_pipe`].

use std::io::{self, Write};

/// Writes one line to stdout; a closed pipe ends the process quietly.
pub fn write_line(args: std::fmt::Arguments) {
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.write_all(b"\n")) {
        exit_on_write_error(e)
    }
}

/// Ends the process after stdout failed: quietly when its reader went away (nothing is left to
/// tell), with the reason otherwise.
pub fn exit_on_write_error(e: io::Error) -> ! {
    if e.kind() == io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("tern: writing to standard output: {e}");
    std::process::exit(1)
}

/// Whether `e` came from writing to a stdout whose reader went away.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| cause.downcast_ref::<io::Error>().is_some_and(|io| io.kind() == io::ErrorKind::BrokenPipe))
}

/// `println!` for command output: see the module.
macro_rules! outln {
    () => {
        $crate::out::write_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::out::write_line(format_args!($($arg)*))
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_broken_pipe_is_found_in_the_chain() {
        let e = anyhow::Error::new(std::io::Error::from(std::io::ErrorKind::BrokenPipe)).context("writing stdout");
        assert!(super::is_broken_pipe(&e));
        assert!(!super::is_broken_pipe(&anyhow::anyhow!("other")));
    }
}
