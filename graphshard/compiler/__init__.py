"""The compiler behind every frontend: the ``torch.compile`` backend bound to one sharded model
(``backend``), the lowering of its graphs with Inductor (``lowering``, ``inductor_cpu``), gradient
synchronisation outside the graph (``grad_sync``) and the report ``explain`` prints (``explain``).
The passes it runs are ``graphshard.passes``."""
