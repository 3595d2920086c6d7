"""Training-time runtime: loss scalers (:mod:`.scaler`), the master-weight optimizer
(:mod:`.optim`) and the pipelined-backprop trainer (:mod:`.pipeline`)."""
