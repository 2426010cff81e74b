"""One process of the multi-process checks in tests/test_multiprocess.py (not a test module itself).

Launched with TLT_JAX_COORDINATOR / TLT_JAX_NUM_PROCESSES / TLT_JAX_PROCESS_ID and
XLA_FLAGS=--xla_force_host_platform_device_count=2.

  python tests/multiprocess_driver.py
      joins the job through tlt_jax.utils.distributed, builds the global (data) mesh over every process's
      devices, and prints one JSON line with what it sees and the result of two cross-process collectives (a
      jitted sum of a data-sharded array and a psum in shard_map).
  python tests/multiprocess_driver.py main-with-workarounds --config ... --workdir ...
      `python -m tlt_jax.main ...` with WORKAROUNDS installed: three shims that stand in for the fixes the
      library still needs under several processes (tests/test_multiprocess.py, BLOCKERS), each printing the
      call sites it covered once ("WORKAROUND ... at file:line"). They show that nothing else differs from
      one process; they are not the fixes.
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np

from tlt_jax.utils import distributed

_SEEN: set[str] = set()


def _site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/tlt_jax/" in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/tlt_jax/', 1)[1]}:{f.lineno}" for f in frames[-3:][::-1]) or "?"


def _note(kind: str, detail: str) -> None:
    site = f"{kind} at {_site()}"
    if site not in _SEEN:
        _SEEN.add(site)
        print(f"WORKAROUND {site} ({detail})", file=sys.stderr, flush=True)


def _is_key(x: object) -> bool:
    import jax

    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _fetch_shim() -> None:
    """np.asarray / jax.device_get of an array sharded over other processes' devices: process_allgather."""
    from jax._src import array as array_lib
    from jax.experimental import multihost_utils

    original = array_lib.ArrayImpl._value

    def value(self):  # noqa: ANN001, ANN202
        if not self.is_fully_addressable and not self.is_fully_replicated:
            _note("host fetch of a non-addressable array", f"{self.shape} {self.sharding.spec}")
            return np.asarray(multihost_utils.process_allgather(self, tiled=True))
        return original.fget(self)

    array_lib.ArrayImpl._value = property(value)


def _device_put_shim() -> None:
    """jax.device_put of process-local jax.Arrays (and typed keys) to a sharding spanning all processes:
    through their host value, which every process holds alike."""
    import jax
    from jax.sharding import Sharding

    put = jax.device_put

    def device_put(x, device=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if jax.process_count() == 1 or not isinstance(device, Sharding) or device.is_fully_addressable:
            return put(x, device, *args, **kwargs)

        def one(leaf):  # noqa: ANN001, ANN202
            if isinstance(leaf, jax.Array) and leaf.is_fully_addressable:
                _note("device_put of a process-local jax.Array to a global sharding", str(leaf.shape))
                if _is_key(leaf):
                    data = put(np.asarray(jax.random.key_data(leaf)), device, *args, **kwargs)
                    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
                leaf = np.asarray(leaf)
            return leaf if _is_key(leaf) else put(leaf, device, *args, **kwargs)

        return jax.tree.map(one, x)

    jax.device_put = device_put


def _checkpoint_shim() -> None:
    """Checkpoint leaves on one local device (orbax refuses host-local arrays with several processes):
    replicated over every process's devices before saving."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tlt_jax.utils import checkpoint

    encode = checkpoint._encode

    def encode_global(state):  # noqa: ANN001, ANN202
        encoded, layout = encode(state)
        if jax.process_count() == 1:
            return encoded, layout
        everywhere = NamedSharding(Mesh(np.asarray(jax.devices()), ("all",)), P())

        def one(path, x):  # noqa: ANN001, ANN202
            if isinstance(x, jax.Array) and len(x.sharding.device_set) == 1:
                _note("host-local checkpoint leaf", jax.tree_util.keystr(path))
                v = np.asarray(x)
                return jax.make_array_from_callback(v.shape, everywhere, lambda idx: v[idx])
            return x

        return jax.tree_util.tree_map_with_path(one, encoded), layout

    checkpoint._encode = encode_global


WORKAROUNDS = (_fetch_shim, _device_put_shim, _checkpoint_shim)


def collectives() -> None:
    spec = distributed.initialize()
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tlt_jax import sharding as shd

    mesh = shd.make_mesh()  # every global device on the data axis
    n = jax.device_count()
    values = np.arange(1, n + 1, dtype=np.float32)  # device d holds d + 1
    x = jax.make_array_from_callback((n,), NamedSharding(mesh, P("data")), lambda idx: values[idx])
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    psum = jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())(x)
    report = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "spec_process_id": spec.process_id,
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "mesh_shape": dict(mesh.shape),
        "local_shards": [float(s.data[0]) for s in x.addressable_shards],
        "sum": float(np.asarray(total)),
        "psum": float(np.asarray(psum)[0]),
    }
    print("RESULT " + json.dumps(report), flush=True)


def main_with_workarounds(argv: list[str]) -> None:
    for install in WORKAROUNDS:
        install()
    from absl import app

    from tlt_jax import main

    sys.argv = ["tlt_jax.main", *argv]
    app.run(main.main, flags_parser=main.parse_flags)


if __name__ == "__main__":
    if sys.argv[1:2] == ["main-with-workarounds"]:
        main_with_workarounds(sys.argv[2:])
    else:
        collectives()
