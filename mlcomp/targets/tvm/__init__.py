"""The TVM target: ``target``, ``build`` (Relax build), ``schedules``, ``tuning``, ``kernels``; ``offload/`` routes ops to torch kernels."""
