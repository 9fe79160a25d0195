"""What a backend author may build on: the job thread every backend runs its work on (``lane``), the job
half of a store over one host buffer (``lane_store``), an index that answers at once (``immediate_index``),
a circuit breaker (``health``), fault hooks for tests (``faults``), warnings that repeat once a minute
(``repeats``), closing on shutdown paths (``closing``), lazy package exports (``lazy``) and the fields
and validators of a backend's config class (``settings``). It imports kvcore's vocabulary and ports only,
never the domain."""
