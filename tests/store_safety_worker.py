"""A store writer for ``tests/test_store_safety.py`` that races another one.

``python tests/store_safety_worker.py STORE KEY ENACTMENT.json NAME COUNT GO``: prints
``READY``, waits until the file ``GO`` exists (so two writers start together), then
``COUNT`` times writes the enactment, named ``NAME``, under ``KEY``
(:func:`disco_jax.store.write_entry`, its record's ``choice`` is ``NAME`` too) and
records a passed verification of what it wrote
(:func:`disco_jax.store.record_verification`; nothing is written when the other writer
replaced the entry in between). Prints ``DONE <writes> <verdicts written>``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disco_jax import store as st  # noqa: E402
from disco_jax.enactment import Enactment  # noqa: E402


def main() -> None:
    root, key, enactment_path, name, count, go = sys.argv[1:7]
    enactment = Enactment.from_json(json.loads(Path(enactment_path).read_text()))
    enactment = enactment._replace(name=name)
    record = st.make_record(key, st.Setup.current(), enactment_fingerprint=enactment.fingerprint,
                            choice=name, hardware=None, hardware_sha256=None,
                            predicted_s={}, measured_s={}, search=None)
    print("READY", flush=True)
    deadline = time.monotonic() + 120
    while not Path(go).exists():
        if time.monotonic() > deadline:
            raise SystemExit("no GO file within 120 s")
        time.sleep(0.001)
    verdicts = 0
    for _ in range(int(count)):
        st.write_entry(key, record, enactment, root=root)
        written = st.record_verification(
            key, enactment_sha256=_own_sha(enactment), ok=True, max_abs_diff=0.0,
            detail=name, root=root)
        verdicts += written is not None
    print(f"DONE {count} {verdicts}", flush=True)


def _own_sha(enactment: Enactment) -> str:
    """The ``enactment_sha256`` :func:`disco_jax.store.write_entry` records for it."""
    data = json.dumps(enactment.to_json(), sort_keys=True).encode("utf-8")
    return hashlib.sha256(data).hexdigest()


if __name__ == "__main__":
    main()
