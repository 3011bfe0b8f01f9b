"""The TVM target: ``target``, ``build`` (the Relax build), ``schedules``, ``tuning``, ``kernels``, ``scope``;
``offload/`` routes ops to torch kernels."""
