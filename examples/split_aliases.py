"""The bug kvtier exists to prevent, on any machine: a kernel handed a CPU address faults where aliases differ.

Run: python examples/split_aliases.py
"""

import numpy as np

from kvtier import DeviceAddress, HostBuffer, get_device_accessible_ptr
from kvtier.errors import IllegalAddress
from kvtier.runtime import ProgramSpec, create, i64


def xor_kernel(memory, dst, src, nbytes):
    """A reference kernel: every address goes through the executing device's address map."""
    memory.view(dst, nbytes)[:] = memory.view(src, nbytes) ^ 0xFF


def no_image(capability):
    raise NotImplementedError("this example kernel has only a Python reference")


XOR = ProgramSpec("example-xor", ("xor",), no_image, {"xor": xor_kernel})


def run_xor(runtime, dst: DeviceAddress, src: DeviceAddress, nbytes: int) -> None:
    stream = runtime.legacy_stream(0)
    runtime.launch(runtime.load_program(XOR, 0), "xor", grid=1, block=32, stream=stream, args=[dst, src, i64(nbytes)])
    stream.synchronize()


def main() -> None:
    runtime = create("emulated:split")  # behaves like MI355X / WSL2; try "emulated:unified" (like the H200)
    with HostBuffer.allocate(8192, "registered", runtime=runtime) as host:
        pages = host.as_tensor().numpy()
        pages[:4096] = np.random.default_rng().integers(0, 256, 4096, dtype=np.uint8)
        cpu = host.cpu_address
        print(f"CPU address {cpu}; device 0 alias {get_device_accessible_ptr(host, 0)}; "
              f"device 1 alias {get_device_accessible_ptr(host, 1)}")
        try:
            # What the seed did: the CPU address passed off as a device address (the resolver never does this).
            run_xor(runtime, DeviceAddress((cpu + 4096).value, 0), DeviceAddress(cpu.value, 0), 4096)
        except IllegalAddress as exc:
            print(f"kernel given the CPU address: {exc}")
        del pages

    runtime = create("emulated:split")  # a fault poisons an emulated device, as on a GPU: start afresh
    with HostBuffer.allocate(8192, "registered", runtime=runtime) as host:
        pages = host.as_tensor().numpy()
        pages[:4096] = np.random.default_rng().integers(0, 256, 4096, dtype=np.uint8)
        run_xor(runtime, get_device_accessible_ptr(host.region(4096, 4096), 0),
                get_device_accessible_ptr(host.region(0, 4096), 0), 4096)
        assert (pages[4096:] == pages[:4096] ^ 0xFF).all()
        print("kernel given the device alias: copied 4096 bytes correctly")
        del pages


if __name__ == "__main__":
    main()
