#!/usr/bin/env bash
# The test command: formatting, the PTX build with its checks and ptxas assembly for sm_90,
# the committed built-in PTX against a fresh build, a crate using ferrolink on stable Rust,
# clippy, rustdoc with warnings as errors, and every test (device tests on the CPU emulator
# here; on CUDA too where a GPU is).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/setup.sh
export FERROLINK_REQUIRE_PTXAS=1
# The built-in kernels are built fresh from device/ (nightly, ptxas) in every step, as
# .cargo/config.toml also asks, and the per-kernel resource table is printed whenever
# host/build.rs runs. Both are exported for the whole run: a variable that changes between
# steps would rerun the build script and rebuild everything that depends on the host crate.
export FERROLINK_BUILD_PTX=1 FERROLINK_PRINT_PTX_RESOURCES=1

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== build (device crate -> PTX, extern/entry checks, ptxas -arch=sm_90 with per-kernel resources)"
cargo build --workspace --all-targets
echo "== built-in PTX matches a fresh build"
bash scripts/check-ptx.sh

echo "== a crate outside the workspace that uses ferrolink builds on stable Rust (committed PTX, no nightly)"
# A throwaway crate in $TMPDIR depends on host/ by path and builds with the stable toolchain
# offline, with the workspace's Cargo.lock (its crates are fetched by the build above) and the
# workspace's target directory (so the registry crates compiled above are reused: a few
# seconds). Its RUSTUP points at a fake rustup that fails loudly, so a build script that
# reached for the nightly (`rustup run nightly …`, as ferrolink-builder does) would fail the
# step. It then loads the built-in module on the CPU emulator.
user="$(mktemp -d "${TMPDIR:-/tmp}/ferrolink-stable-user.XXXXXX")"
mkdir -p "$user/bin" "$user/app/src"
cat > "$user/bin/rustup" <<'SH'
#!/bin/sh
echo "stable-user check: the build ran \`rustup $*\`; without FERROLINK_BUILD_PTX=1 it must not need nightly" >&2
touch "$(dirname "$0")/../rustup-was-called"
exit 97
SH
chmod +x "$user/bin/rustup"
cat > "$user/app/Cargo.toml" <<TOML
[package]
name = "ferrolink-stable-user"
version = "0.0.0"
edition = "2024"
publish = false

[dependencies]
ferrolink = { path = "$root/host" }

[workspace]
TOML
cat > "$user/app/src/main.rs" <<'RS'
fn main() {
    let dev = ferrolink::Device::open_with(ferrolink::Backend::Cpu, 0).expect("the CPU emulator opens");
    dev.builtin_module().expect("the committed built-in PTX loads");
    assert!(ferrolink::DEVICE_PTX.contains(".entry "), "the built-in PTX has kernel entries");
    println!("stable user: {} bytes of built-in PTX, loaded on the CPU emulator", ferrolink::DEVICE_PTX.len());
}
RS
cp Cargo.lock "$user/app/Cargo.lock"
(
  cd "$user/app"
  env -u FERROLINK_BUILD_PTX -u FERROLINK_PRINT_PTX_RESOURCES -u FERROLINK_PTXAS -u FERROLINK_REQUIRE_PTXAS \
    RUSTUP="$user/bin/rustup" PATH="$user/bin:$PATH" RUSTUP_TOOLCHAIN=stable \
    CARGO_TARGET_DIR="$root/target" cargo +stable run --offline --quiet
)
if [ -e "$user/rustup-was-called" ]; then
  echo "error: building a crate that uses ferrolink ran rustup (see above): it must build on stable alone" >&2
  exit 1
fi
rm -rf "$user"

echo "== cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== the RDMA verbs GIN transport (cargo feature; no NIC here: it builds, and its NIC-free parts are tested)"
cargo clippy -p ferrolink --features verbs --all-targets --quiet -- -D warnings
cargo test -p ferrolink --features verbs --lib --quiet verbs 2>&1 | tail -3
echo "== cargo doc (broken links and doc warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
echo "== cargo test"
cargo test --workspace 2>&1
echo "== examples as multi-process jobs on the emulator (ferrolink-run, 2 and 4 processes)"
# Where cargo put them: the default target dir, or the caller's CARGO_TARGET_DIR.
bin="${CARGO_TARGET_DIR:-target}/debug"
for n in 2 4; do
  for ex in 02_ring 03_allreduce 05_fused 06_barrier 07_gin_ping_pong 08_all_to_all 09_collectives 10_p2p_graphs_persistent 11_moe_fused; do
    FERROLINK_BOOTSTRAP_TIMEOUT=60 timeout 300 "$bin/ferrolink-run" -n "$n" --backend cpu "$bin/examples/$ex" > /tmp/ferrolink-job.log 2>&1 \
      || { cat /tmp/ferrolink-job.log; echo "error: $ex as a $n-process job failed" >&2; exit 1; }
    echo "$ex -n $n: $(grep -cE "verified|no stale|matches|round trips|intact" /tmp/ferrolink-job.log) lines of success from $n ranks"
  done
done
echo "== miri (the emulator's shared memory, argument passing and failure stops; scripts/miri.sh)"
bash scripts/miri.sh
