"""The bug kvtier exists to prevent, on any machine: a kernel handed a CPU address faults where aliases differ.

Run: python examples/split_aliases.py
"""

import numpy as np

from kvtier import HostBuffer, get_device_accessible_ptr
from kvtier.errors import IllegalAddress
from kvtier.runtime import create


def xor_kernel(memory, dst, src, nbytes):
    """A reference kernel: every address goes through the executing device's address map."""
    memory.view(dst, nbytes)[:] = memory.view(src, nbytes) ^ 0xFF


runtime = create("emulated:split")  # behaves like MI355X / WSL2; try "emulated:unified" (like the H200)
with HostBuffer.allocate(8192, "registered", runtime=runtime) as host:
    pages = host.as_tensor().numpy()
    pages[:4096] = np.random.default_rng().integers(0, 256, 4096, dtype=np.uint8)
    src, dst = host.cpu_address, host.cpu_address + 4096
    print(f"CPU address {src}; device 0 alias {get_device_accessible_ptr(host, 0)}; "
          f"device 1 alias {get_device_accessible_ptr(host, 1)}")
    try:
        runtime.run_python(xor_kernel, dst.value, src.value, 4096, device=0)
    except IllegalAddress as exc:
        print(f"kernel given the CPU address: {exc}")
    alias = get_device_accessible_ptr(host, 0)
    runtime.run_python(xor_kernel, (alias + 4096).value, alias.value, 4096, device=0)
    assert (pages[4096:] == pages[:4096] ^ 0xFF).all()
    print("kernel given the device alias: copied 4096 bytes correctly")
    del pages
