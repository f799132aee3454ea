"""The demo and the self-check: `arl demo` (`demo_run`), `arl doctor` (`doctor`, `doctor_checks`), the
tiny offline model (`tiny_model`) and its format-only warm start (`warm_start`)."""
