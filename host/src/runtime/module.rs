//! Modules of kernels loaded from PTX.

use crate::runtime::backend::ModuleBackend;
use crate::runtime::device::{Device, DeviceInner};
use crate::runtime::lifetime::{self, Untracked, Uses};
use crate::{Error, Result};
use std::collections::HashSet;
use std::sync::{Arc, Weak};

/// How a module refers to its device: a user's module keeps the device alive; the device's
/// own built-in module (stored inside the device) refers back weakly, or the two would keep
/// each other alive forever.
enum DeviceLink {
    Owner(Device),
    Builtin(Weak<DeviceInner>),
}

/// A module of kernels loaded from PTX (see [`Device::load_module`]). On the CPU backend the
/// kernels run from their host entries, and the PTX tells which entries the module declares.
/// Dropping it never waits: it is unloaded once the kernels launched from it have finished.
///
/// ```
/// # use ferrolink::LaunchConfig;
/// # use ferrolink_device::kernels::copy::ferrolink_copy;
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let stream = dev.create_stream()?;
/// let module = dev.load_module(ferrolink::DEVICE_PTX)?;
/// let (src, mut dst) = (dev.alloc_from(&[4u8; 64])?, dev.alloc::<u8>(64)?);
/// // SAFETY: the copy kernel's contract: 64 bytes each, no overlap.
/// unsafe { stream.launch(&module, &ferrolink_copy, LaunchConfig::linear(1, 32), (&mut dst, &src, 64usize))? };
/// drop(module); // does not wait: unloaded once the kernel has run
/// assert_eq!(dst.to_vec()?, vec![4u8; 64]);
/// # Ok(()) }
/// ```
pub struct Module {
    link: DeviceLink,
    imp: Option<Box<dyn ModuleBackend>>,
    entries: HashSet<String>,
    /// The entries that launch graphs from the device ([`graph_launching_entries`]).
    graph_launchers: HashSet<String>,
    pub(crate) uses: Arc<Uses>,
    untracked: Arc<Untracked>,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module").field("entries", &self.entries).finish()
    }
}

impl Module {
    pub(crate) fn load(dev: &Device, ptx: &str, cubin: Option<&[u8]>) -> Result<Module> {
        Module::load_linked(dev, ptx, cubin, DeviceLink::Owner(dev.clone()))
    }

    /// Loads the device's built-in module, which the device itself stores.
    pub(crate) fn load_builtin(dev: &Device, ptx: &str, cubin: Option<&[u8]>) -> Result<Module> {
        Module::load_linked(dev, ptx, cubin, DeviceLink::Builtin(Arc::downgrade(&dev.0)))
    }

    fn load_linked(dev: &Device, ptx: &str, cubin: Option<&[u8]>, link: DeviceLink) -> Result<Module> {
        let entries: HashSet<String> = ferrolink_device::kernel::ptx_entry_names(ptx).map(str::to_string).collect();
        if entries.is_empty() {
            return Err(Error::InvalidArgument("the PTX declares no kernel entry (.entry)".into()));
        }
        let graph_launchers = graph_launching_entries(ptx);
        let imp = dev.backend_device().load_module(ptx, cubin, &entries, declares_device_runtime(ptx))?;
        Ok(Module {
            link,
            imp: Some(imp),
            entries,
            graph_launchers,
            uses: Arc::default(),
            untracked: dev.0.untracked.clone(),
        })
    }

    /// The device the module was loaded on, if it is still alive.
    fn device(&self) -> Option<Device> {
        match &self.link {
            DeviceLink::Owner(d) => Some(d.clone()),
            DeviceLink::Builtin(w) => w.upgrade().map(Device),
        }
    }

    /// Whether the module was loaded on `dev`.
    pub(crate) fn belongs_to(&self, dev: &Device) -> bool {
        // The same device object first, without touching its reference counts (every launch
        // asks, from every rank thread): `dev` holds it alive, so an equal address is it.
        let same_object = match &self.link {
            DeviceLink::Owner(d) => Arc::ptr_eq(&d.0, &dev.0),
            DeviceLink::Builtin(w) => std::ptr::eq(w.as_ptr(), Arc::as_ptr(&dev.0)),
        };
        same_object || self.device().is_some_and(|d| d.same_as(dev))
    }

    /// Whether the module declares a kernel entry called `name`.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let module = dev.builtin_module()?;
    /// assert!(module.has_kernel("ferrolink_copy"));
    /// assert!(!module.has_kernel("no_such_kernel"));
    /// # Ok(()) }
    /// ```
    pub fn has_kernel(&self, name: &str) -> bool {
        self.entries.contains(name)
    }

    /// Whether kernel `name` launches graphs from the device (its PTX calls the device
    /// runtime's `cudaGraphLaunch`, itself or through functions it calls): such a kernel may
    /// be launched only inside a graph.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let ptx = ".version 8.6\n.target sm_90\n.address_size 64\n\n\
    ///            .extern .func (.param .b32 r) cudaGraphLaunch\n(\n\t.param .b64 g,\n\t.param .b64 s\n)\n;\n\
    ///            .visible .entry scheduler()\n{\n\
    ///            \tcall.uni (retval0), cudaGraphLaunch, (param0, param1);\n\tret;\n}\n\
    ///            .visible .entry worker()\n{\n\tret;\n}\n";
    /// let module = dev.load_module(ptx)?;
    /// assert!(module.launches_graphs("scheduler"));
    /// assert!(!module.launches_graphs("worker"));
    /// # Ok(()) }
    /// ```
    pub fn launches_graphs(&self, name: &str) -> bool {
        self.graph_launchers.contains(name)
    }

    /// How many CTAs of `kernel` (launched with `cfg`'s block and shared memory) the device
    /// holds at once (the occupancy API times the SMs); `None` on the emulator, which runs
    /// every CTA of a grid at once. Kernels whose CTAs wait for each other (or for other
    /// ranks' CTAs on the same GPU) need every CTA resident. On every backend, a kernel the
    /// module does not declare is [`Error::KernelNotFound`], and a configuration that cannot
    /// launch is refused as [`LaunchConfig::validate`](crate::LaunchConfig::validate) says.
    ///
    /// ```
    /// # use ferrolink_device::kernels::copy::ferrolink_copy;
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// let module = dev.builtin_module()?;
    /// let cfg = ferrolink::LaunchConfig::linear(1, 256);
    /// assert_eq!(module.resident_ctas(&ferrolink_copy, cfg)?, None); // the emulator runs every CTA at once
    /// assert!(module.resident_ctas(&ferrolink_copy, ferrolink::LaunchConfig::linear(1, 2048)).is_err());
    /// # Ok(()) }
    /// ```
    pub fn resident_ctas<A: ferrolink_device::kernel::KernelArgs>(
        &self,
        kernel: &ferrolink_device::kernel::Kernel<A>,
        cfg: crate::LaunchConfig,
    ) -> Result<Option<u64>> {
        if !self.has_kernel(kernel.name()) {
            return Err(crate::Error::KernelNotFound(kernel.name().to_string()));
        }
        cfg.validate(kernel.name())?;
        // At most 1024 once validated.
        let threads = cfg.block_threads() as u32;
        let per_sm = self.backend().resident_ctas_per_sm(kernel.name(), threads, cfg.shared_mem_bytes)?;
        let sms = self.device().map_or(0, |d| d.sm_count());
        Ok(per_sm.map(|n| u64::from(n) * u64::from(sms)))
    }

    pub(crate) fn backend(&self) -> &dyn ModuleBackend {
        self.imp.as_deref().expect("present until drop")
    }
}

/// The device runtime's function that a kernel calls to launch a graph.
const GRAPH_LAUNCH_FUNCTION: &str = "cudaGraphLaunch";

/// Whether `ptx` declares the device runtime's graph launch (`.extern .func ...
/// cudaGraphLaunch(`): the module is then linked with the device runtime when it is loaded,
/// whether or not an entry reaches the call (an unresolved declaration would not load).
fn declares_device_runtime(ptx: &str) -> bool {
    ptx.lines().any(|l| {
        l.trim_start().starts_with(".extern .func")
            && l.split(|c: char| c == '(' || c == ')' || c.is_whitespace()).any(|w| w == GRAPH_LAUNCH_FUNCTION)
    })
}

/// The kernel entries of `ptx` that call `cudaGraphLaunch`, directly or through the
/// functions they call (a scan of the PTX's `call` instructions, body by body).
fn graph_launching_entries(ptx: &str) -> HashSet<String> {
    use std::collections::HashMap;
    // Each defined function's and entry's callees; entries apart.
    let mut calls: HashMap<&str, HashSet<&str>> = HashMap::new();
    let mut entries = Vec::new();
    let mut current: Option<&str> = None;
    for line in ptx.lines() {
        let l = line.trim_start();
        let header = l.strip_prefix(".visible ").or_else(|| l.strip_prefix(".weak ")).unwrap_or(l);
        if let Some(rest) = header.strip_prefix(".entry ") {
            let name = rest.split(|c: char| c == '(' || c.is_whitespace()).next().unwrap_or("");
            entries.push(name);
            current = Some(name);
        } else if let Some(rest) = header.strip_prefix(".func ") {
            // `.func (.param .b32 r) name(` or `.func name(`
            let rest = rest.trim_start();
            let rest = if rest.starts_with('(') { rest.find(')').map_or("", |i| &rest[i + 1..]) } else { rest };
            current = rest.trim_start().split(|c: char| c == '(' || c.is_whitespace()).next();
        } else if let (Some(f), Some(rest)) = (current, l.strip_prefix("call")) {
            // `call.uni (retval0), name, (args);` or `call.uni name, (args);`
            let rest = rest.trim_start_matches(|c: char| c != ' ' && c != '\t').trim_start();
            let rest = if rest.starts_with('(') { rest.find("),").map_or("", |i| &rest[i + 2..]) } else { rest };
            if let Some(callee) = rest.trim_start().split([',', ';', ' ']).next() {
                calls.entry(f).or_default().insert(callee);
            }
        }
    }
    // Functions that reach the target, to a fixed point.
    let mut reaching: HashSet<&str> = HashSet::from([GRAPH_LAUNCH_FUNCTION]);
    loop {
        let before = reaching.len();
        for (f, callees) in &calls {
            if callees.iter().any(|c| reaching.contains(c)) {
                reaching.insert(f);
            }
        }
        if reaching.len() == before {
            break;
        }
    }
    entries.into_iter().filter(|e| reaching.contains(e)).map(str::to_string).collect()
}

impl Drop for Module {
    fn drop(&mut self) {
        let mut waits = self.uses.pending_for_free();
        waits.extend(self.untracked.pending_for_free());
        if let Some(imp) = self.imp.take() {
            lifetime::retire(waits, Box::new(imp), "module");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{declares_device_runtime, graph_launching_entries};

    /// Entries that call `cudaGraphLaunch`, themselves or through a function, are found;
    /// others are not (rustc's PTX layout).
    #[test]
    fn entries_that_launch_graphs_are_found_through_their_calls() {
        let ptx = ".extern .func  (.param .b32 func_retval0) cudaGraphLaunch\n(\n\t.param .b64 p0\n)\n;\n\
                   .func _ZN6helper(\n\t.param .b64 a\n)\n{\n\tcall.uni (retval0), cudaGraphLaunch, (param0, param1);\n}\n\
                   .func  (.param .b32 func_retval0) _ZN5other(\n)\n{\n\tret;\n}\n\
                   .visible .entry direct(\n)\n{\n\tcall.uni (retval0), cudaGraphLaunch, (param0, param1);\n}\n\
                   .visible .entry indirect(\n)\n{\n\tcall.uni _ZN6helper, (param0);\n}\n\
                   .visible .entry plain(\n)\n{\n\tcall.uni (retval0), _ZN5other, ();\n\tret;\n}\n";
        let mut found: Vec<String> = graph_launching_entries(ptx).into_iter().collect();
        found.sort();
        assert_eq!(found, ["direct", "indirect"]);
        assert!(declares_device_runtime(ptx));
        assert!(!declares_device_runtime(
            ".extern .func (.param .b32 r) vprintf\n(\n)\n;\n.visible .entry plain(\n)\n{\n}\n"
        ));
    }
}
