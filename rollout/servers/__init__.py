"""SGLang servers as the run sees them: launching them (and sglang-router) as child processes, their
memory settings, health and recovery in long runs, the HTTP client of one server and the pool of
several, the weight-update calls, and the ports the run's processes use."""
