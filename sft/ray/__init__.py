"""The Ray launch path: :mod:`~sft.ray.flags` (the launcher's flags), :mod:`~sft.ray.placement` (pure
placement arithmetic), :mod:`~sft.ray.worker` (the coordinator actor and Ray Train's training function) and
:mod:`~sft.ray.driver` (run once on a node of the cluster: ``sft-ray``). Importing this package imports no Ray."""
