"""What runs for a train step: the :class:`Enactment` value and how it is built
(:mod:`~disco_jax.enactment.enactment`), staged enactment on two streams
(:mod:`~disco_jax.enactment.staged`), and plans checked by compiling them in a child
process (:mod:`~disco_jax.enactment.plan_check`)."""

from disco_jax.enactment.enactment import (
    FORMAT,
    SINGLE,
    STAGED,
    STAGED_ENV,
    Enactment,
    build,
    single_module,
)

__all__ = ["FORMAT", "SINGLE", "STAGED", "STAGED_ENV", "Enactment", "build", "single_module"]
