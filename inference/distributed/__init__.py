"""One model version over several nodes: pipeline (layer ranges) or expert-parallel
(class ranges), each node opening its own store through its portal; Ray carries the
activations (:mod:`.stages` is the per-node work, :mod:`.ray_cluster` the actors and
drivers; Ray is the optional extra ``czyx[ray]``)."""
