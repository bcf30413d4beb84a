"""The benchmark harness behind `jaxsparse bench` and benchmarks/ (not public API): timing
(kernel time from the device trace, in-graph loops, host timing), benchmark cases, the named
model shapes, and JSON / table output."""
