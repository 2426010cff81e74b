"""A reduced draft vocabulary as SGLang's `--speculative-token-map` file, written and read without torch.

SGLang's EAGLE worker reads the token map with `torch.load(path, weights_only=True)` and turns it into a
tensor of target token ids: the rows of the target's LM head the drafter drafts over
(sglang/srt/speculative/eagle_worker.py, `load_token_map`). `torch.save` of a Python list writes a zip
archive whose `<name>/data.pkl` is the pickled list (protocol 2) beside `<name>/byteorder` and
`<name>/version`; that is what `write_token_map` writes, so a GPU node without torch (`make setup-gpu`)
still exports a drafter SGLang loads with its reduced vocabulary (tests/drafter/test_eagle_format.py loads
one with torch). `read_token_map` reads such a list back (ours, or any torch-saved list of ints)."""

from __future__ import annotations

import io
import os
import pickle
import zipfile

import numpy as np

TOKEN_MAP_FILE = "token_map.pt"


def write_token_map(path: str | os.PathLike, token_ids: np.ndarray) -> None:
    """Write the sorted target token ids `token_ids` as a torch-loadable list of ints."""
    ids = [int(i) for i in np.asarray(token_ids, np.int64).reshape(-1)]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("token_map/data.pkl", pickle.dumps(ids, protocol=2))
        z.writestr("token_map/byteorder", "little")
        z.writestr("token_map/version", "3\n")


class _IdsOnly(pickle.Unpickler):
    """Unpickles plain data only: a token map that names any class (a torch tensor) is refused."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_token_map(path: str | os.PathLike) -> np.ndarray:
    """The token ids of a token map file (a torch-saved list of ints), or a ValueError saying what it is."""
    try:
        with zipfile.ZipFile(path) as z:
            data = next((n for n in z.namelist() if n.endswith("/data.pkl")), None)
            if data is None:
                raise ValueError("no data.pkl in the archive")
            ids = _IdsOnly(io.BytesIO(z.read(data))).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError) as e:
        raise ValueError(
            f"{path} is not a token map of token ids (a torch-saved list of ints): {e}. Save one with "
            "`torch.save(ids.tolist(), path)`."
        ) from None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{path} holds a {type(ids).__name__}, not a list of token ids")
    return np.asarray(ids, np.int64)
