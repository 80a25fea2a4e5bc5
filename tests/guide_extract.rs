//! Splits docs/device-api.md into the code of its device crate and of its host program, for
//! the build scripts of `ferrolink-guide-kernels` and `ferrolink-tests` (included by both
//! with `#[path]`). Every ```` ```rust ```` block of the guide is code: the first is the device
//! crate's header, the second the host program's, a block that starts with `fn sN_…(` is a
//! host function, and every other block belongs to the device crate. Blocks tagged
//! `rust,ignore` (abridged signatures, fragments) are left out. A host function tagged
//! `rust,deadlocks` shows a mistake that hangs on a GPU: it is compiled, and run only on the
//! CPU emulator, where its launch must end with the emulator's timeout error.

/// The guide's code, split.
pub struct Guide {
    /// The device crate's code: its header's `use` lines and every device block.
    pub device: String,
    /// The host program's header and functions.
    pub host: String,
    /// The names of the host functions (`s1_scale_add`, …), in order.
    pub host_fns: Vec<String>,
    /// The names of the host functions tagged `rust,deadlocks`.
    pub deadlocking_fns: Vec<String>,
}

/// Splits `markdown` (see the module docs).
pub fn split(markdown: &str) -> Guide {
    let mut blocks = Vec::new();
    let mut current: Option<(String, bool)> = None;
    for line in markdown.lines() {
        match &mut current {
            None if line.trim_end() == "```rust" => current = Some((String::new(), false)),
            None if line.trim_end() == "```rust,deadlocks" => current = Some((String::new(), true)),
            None => {}
            Some(_) if line.starts_with("```") => blocks.push(current.take().unwrap_or_default()),
            Some((block, _)) => {
                block.push_str(line);
                block.push('\n');
            }
        }
    }
    let mut guide =
        Guide { device: String::new(), host: String::new(), host_fns: Vec::new(), deadlocking_fns: Vec::new() };
    for (i, (block, deadlocks)) in blocks.iter().enumerate() {
        let host_fn = block.strip_prefix("fn ").and_then(|rest| rest.split('(').next()).filter(|name| {
            name.starts_with('s') && name[1..].split('_').next().is_some_and(|n| n.parse::<u32>().is_ok())
        });
        if let Some(name) = host_fn.filter(|_| i > 1) {
            let names = if *deadlocks { &mut guide.deadlocking_fns } else { &mut guide.host_fns };
            names.push(name.to_string());
        }
        let target = if i == 1 || (i > 1 && host_fn.is_some()) { &mut guide.host } else { &mut guide.device };
        // Inner attributes (`#![no_std]`, …) of the device header must sit at the crate root,
        // which has them.
        for line in block.lines().filter(|l| i != 0 || !l.starts_with("#![")) {
            target.push_str(line);
            target.push('\n');
        }
        target.push('\n');
    }
    guide
}
