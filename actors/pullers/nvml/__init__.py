"""The NVML input (``--input nvml``): one GPUReport per tick with every GPU's readings, through
``nvidia-ml-py``. One module per concern, each importing only those above it:

- ``api``: the one seam to the NVML library (typed errors, one-call readers), also used by
  ``wattflow check``;
- ``config``: the input's settings;
- ``device``: what the sampler keeps per GPU, its failure accounting and schedule, and the
  readings of the device itself (power and energy, sample buffers, slow readings, PCIe);
- ``processes``: per-process utilisation windows and the processes' cgroups;
- ``mig``: under MIG, the GPU instances and their GPM windows;
- ``sampler``: :class:`~wattflow.actors.pullers.nvml.sampler.NvmlSampler`, the blocking part
  that reads every device once a tick;
- ``pacing``: the threads that keep time and refresh PCIe throughput;
- ``puller``: the registered input, which hands the ticks to the pipeline.

Nothing is imported here: the registry of inputs loads ``puller`` when ``nvml`` is asked for,
and ``pynvml`` is imported only when NVML is opened, so nodes without GPUs need neither.
"""
