"""Can this device run this package? Decided from the manifest and the device alone, before any
allocation or module load, so an incompatible GPU fails in one clear line.

Rules (pure functions, unit-tested on the CPU):

* cubins are architecture-exact: a package for ``sm_90`` runs its cubins on compute capability 9.0
  only. A newer device (e.g. 10.0) can JIT the package's PTX (``compute_90``) — allowed for an
  explicit ``backend="cuda"``, never chosen by ``auto`` (which wants a matching sm). ``sm_90a``-style
  targets use architecture-specific instructions and have no forward path. An older device never runs.
* the driver must be new enough for the NVRTC that compiled the kernels: a cubin needs a driver of
  the same CUDA major version or newer (minor-version compatibility); JIT-compiling PTX needs a
  driver at least as new as that NVRTC (major.minor), since PTX of a newer ISA is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

from lum.format.manifest import parse_sm

__all__ = ["Compatibility", "parse_sm", "parse_version", "check_target"]


@dataclass(frozen=True)
class Compatibility:
    ok: bool
    use_ptx: bool          # load PTX (JIT) instead of the cubins
    reason: str            # one line: why it runs (and how) or why not


def parse_version(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


def check_target(target_sm: str, nvrtc: str | None, device_cc: tuple[int, int], driver_version: int,
                 has_ptx: bool, device_name: str = "this GPU", allow_ptx: bool = True) -> Compatibility:
    """Whether a package for ``target_sm`` (kernels by NVRTC ``nvrtc``) runs on a device of compute
    capability ``device_cc`` under a driver reporting ``driver_version`` (e.g. 13000)."""
    major, minor, suffix = parse_sm(target_sm)
    drv = (driver_version // 1000, (driver_version % 1000) // 10)
    dev = f"{device_name} (sm_{device_cc[0]}{device_cc[1]}, driver CUDA {drv[0]}.{drv[1]})"
    built = parse_version(nvrtc)
    if (major, minor) == tuple(device_cc):
        if built is not None and drv[0] < built[0]:
            return Compatibility(False, False, f"the package's kernels were compiled by NVRTC {built[0]}.{built[1]} "
                                               f"and need a CUDA {built[0]} driver; {dev} has an older one")
        return Compatibility(True, False, f"{dev} matches the package target {target_sm}")
    if tuple(device_cc) < (major, minor):
        return Compatibility(False, False, f"the package targets {target_sm}; {dev} is older")
    if suffix:
        return Compatibility(False, False, f"the package targets {target_sm}, whose architecture-specific "
                                           f"kernels run on exactly that architecture, not on {dev}")
    if not allow_ptx:
        return Compatibility(False, False, f"the package targets {target_sm}, not {dev} (rebuild it with "
                                           f"--target sm_{device_cc[0]}{device_cc[1]}, or ask for backend='cuda' "
                                           f"to JIT its PTX)")
    if not has_ptx:
        return Compatibility(False, False, f"the package targets {target_sm} and carries no PTX to JIT for {dev}")
    if built is not None and drv < built:
        return Compatibility(False, False, f"the package's PTX comes from NVRTC {built[0]}.{built[1]}; "
                                           f"{dev} cannot JIT it (driver too old)")
    return Compatibility(True, True, f"{dev} runs the package ({target_sm}) by JIT-compiling its PTX")
