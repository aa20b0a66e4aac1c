import numpy as np
from kvtier.runtime import create, get
from kvtier.pools.state import StateGeometry, StateDevicePool, StateHostPool
from kvtier.pools.paged_rows import PagedRowGeometry, PagedRowDevicePool, PagedRowHostPool
from kvtier.transfer.family import FamilyEngine
from kvtier.memory import CpuAddress
rng = np.random.default_rng()
import sys
for mode in sys.argv[1:] or ("split", "unified"):
    rt = get("cuda") if mode == "cuda" else create(f"emulated:{mode}")
    g = StateGeometry.mamba(3, (10, 3), (2, 4, 6), conv_dtype="float16")
    dev = StateDevicePool.allocate(g, 5, 0, runtime=rt, request_major=True, pad=6)
    host = StateHostPool.allocate(g, "page_first_direct", slots=4, runtime=rt)
    eng = FamilyEngine(dev, host)
    view = host.buffer.as_tensor().numpy()
    data = rng.integers(1, 255, view.size, dtype=np.uint8); view[:] = data
    t = eng.load([2, 0], [4, 1]); t.wait()
    view[:] = 0xEE
    eng.backup([4, 1], [0, 3]).wait()
    out = view.copy()
    slot = g.slot_bytes
    assert (out[0:slot] == data[2*slot:3*slot]).all(), mode
    assert (out[3*slot:4*slot] == data[0:slot]).all()
    assert (out[slot:3*slot] == 0xEE).all()
    del view; eng.close(); dev.close(); host.close()
    r = PagedRowGeometry.dsv4_c4_kv(4, page_size=4, stored_layers=(0, 2, 3))
    dev = PagedRowDevicePool.allocate(r, 6, 0, runtime=rt, pad=16)
    host = PagedRowHostPool.allocate(r, "layer_first", pages=5, runtime=rt)
    eng = FamilyEngine(dev, host)
    view = host.buffer.as_tensor().numpy()
    data = rng.integers(1, 255, view.size, dtype=np.uint8); view[:] = data
    eng.load([1, 3], [0, 5]).wait()
    eng.load([9, 10, 17], [12, 13, 14], unit="token").wait()
    view[:] = 0xEE
    eng.backup([0, 5], [4, 2]).wait()
    eng.backup([12, 13, 14], [1, 5, 6], unit="token").wait()
    out = view.copy()
    pb = r.page_bytes
    for li in range(3):
        base = li * 5 * pb
        assert (out[base+4*pb:base+5*pb] == data[base+1*pb:base+2*pb]).all()
        assert (out[base+2*pb:base+3*pb] == data[base+3*pb:base+4*pb]).all()
        for name, off, size in r.region_offsets():
            for src_t, dst_t in zip([9, 10, 17], [1, 5, 6]):
                sp, ss = divmod(src_t, 4); dp, ds = divmod(dst_t, 4)
                a = base + dp*pb + off + ds*size; b = base + sp*pb + off + ss*size
                assert (out[a:a+size] == data[b:b+size]).all(), (name, src_t)
        # untouched: host page 0 except tokens 1, page 3 all
        assert (out[base+3*pb:base+4*pb] == 0xEE).all()
    del view; eng.close(); dev.close(); host.close()
    print(mode, "ok")
