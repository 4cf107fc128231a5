"""A store writer for ``tests/test_store.py`` that the test kills mid-write.

``python tests/jit_killed_writer.py STORE KEY ENACTMENT.json``: writes the entry with
:func:`disco_jax.store.write_entry`, but the rename that would publish the finished
temporary directory prints ``READY`` and blocks, so the test can SIGKILL the process
with the whole entry written and not yet renamed (the worst moment to die).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disco_jax import store as st  # noqa: E402
from disco_jax.enactment import Enactment  # noqa: E402

_rename = os.rename


def _blocking_rename(src, dst, *args, **kwargs):
    if Path(src).name.startswith(".tmp-"):
        print("READY", flush=True)
        time.sleep(600)
    return _rename(src, dst, *args, **kwargs)


def main() -> None:
    root, key, enactment_path = sys.argv[1:4]
    enactment = Enactment.from_json(json.loads(Path(enactment_path).read_text()))
    record = st.make_record(key, st.Setup.current(), enactment_fingerprint=enactment.fingerprint,
                            choice=enactment.name, hardware=None, hardware_sha256=None,
                            predicted_s={}, measured_s={}, search=None)
    os.rename = _blocking_rename
    st.write_entry(key, record, enactment, root=root)
    print("WRITTEN", flush=True)


if __name__ == "__main__":
    main()
