"""The product path, one step per module, in the order a step takes them:

* :mod:`~disco_jax.pipeline.sync` -- the job sync of a multi-process pipeline;
* :mod:`~disco_jax.pipeline.profile` -- the in-context profile;
* :mod:`~disco_jax.pipeline.fit` -- the cost model fitted to it;
* :mod:`~disco_jax.pipeline.search` -- Algorithm 1 over plans;
* :mod:`~disco_jax.pipeline.choose` -- measuring side by side and the final choice;
* :mod:`~disco_jax.pipeline.optimize` -- ``optimize_step``, the steps composed for one
  train step (what ``disco_jax.jit`` runs under ``ENABLE_SEARCH=1``);
* :mod:`~disco_jax.pipeline.bench` -- ``disco bench``'s jobs.
"""
