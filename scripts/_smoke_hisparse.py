import numpy as np
from kvtier.runtime import create, get
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.transfer.hisparse import HotBuffer
from kvtier.memory import CpuAddress
rng = np.random.default_rng(1)
import sys
for mode in sys.argv[1:] or ("split", "unified"):
    rt = get("cuda") if mode == "cuda" else create(f"emulated:{mode}")
    N, K, T, R, L = 8, 4, 40, 2, 2
    hg = KVGeometry.mla(L, 64, 4)
    dg = KVGeometry.mla(L, 64, 1)
    dev = DevicePool.allocate(dg, R * (N + 1), 0, runtime=rt)
    host = HostPool.allocate(hg, "page_first", pages=R * T // 4, runtime=rt)
    view = host.buffer.as_tensor().numpy()
    data = rng.integers(1, 255, view.size, dtype=np.uint8); view[:] = data
    hb = HotBuffer(dev, host, requests=R, slots=N, top_k=K, max_tokens=T)
    for r in range(R):
        hb.assign(r, np.arange(r * T, (r + 1) * T))
    def host_row(layer, unit):
        st = host.strides
        page, slot = divmod(unit, 4)
        off = layer * st.layer + page * st.page + slot * st.slot
        return data[off:off + 64]
    def dev_row(layer, row):
        out = np.empty(64, np.uint8)
        rt.memcpy(CpuAddress(out.ctypes.data), dev.layer_device_addresses(0)[layer] + int(row) * 64, 64)
        return out
    # model: expected state
    lru = {r: list(range(N)) for r in range(R)}
    slot_tok = {r: list(range(N)) for r in range(R)}
    for step in range(6):
        seq = 20 + step
        top = np.stack([rng.choice(seq, K, replace=False) for _ in range(R)]).astype(np.int32)
        out = hb.swap_in(1, [0, 1], top, [seq, seq])
        hb.synchronize()
        locs = np.frombuffer(out.download(0, R * K * 8), np.int64).reshape(R, K)
        for r in range(R):
            hits = [s for s in lru[r] if slot_tok[r][s] in top[r]]
            ev = [s for s in lru[r] if slot_tok[r][s] not in top[r]]
            misses = [t for t in top[r] if t != seq - 1 and t not in slot_tok[r]]
            vict = ev[:len(misses)]
            lru[r] = ev[len(misses):] + vict + hits
            for t, s in zip(misses, vict):
                slot_tok[r][s] = int(t)
            st = hb.read_state(r, 1)
            assert st["lru"].tolist() == lru[r], (mode, step, r, st["lru"], lru[r])
            assert st["slot_tokens"][:N].tolist() == slot_tok[r]
            for i, t in enumerate(top[r]):
                if t == seq - 1:
                    assert locs[r, i] == r * (N + 1) + N
                    continue
                s = slot_tok[r].index(t)
                assert locs[r, i] == r * (N + 1) + s
                if t in misses:
                    assert (dev_row(1, locs[r, i]) == host_row(1, r * T + t)).all()
    del view
    hb.close(); dev.close(); host.close()
    print(mode, "ok")
