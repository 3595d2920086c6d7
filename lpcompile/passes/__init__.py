"""Graph rewrites, grouped by the phase they run in, and the driver that runs them.

* :mod:`.dynamo`: the Dynamo graph (torch IR), where layers are explicit calls.
* :mod:`.joint`: AOT autograd's joint forward+backward graph, inside Inductor,
  before it is partitioned (and inference graphs, which have no backward).
* :mod:`.aot`: each partitioned AOT graph (forward, backward, inference).

Each phase has one ordered list of :class:`~lpcompile.passes.driver.Pass`, each
with the condition under which it applies; :func:`~lpcompile.passes.driver.run_passes`
runs a list and records what every pass did. :mod:`.graph` holds the FX helpers
the passes and the pipeline share, :mod:`.stages` the pipeline-stage partitioner.
"""
