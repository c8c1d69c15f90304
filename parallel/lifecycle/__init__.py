"""The run's lifecycle and failure guard: start-up (entry point, rendezvous, process groups), the watchdog
and heartbeats, preemption, fault injection, how a failing process speaks and ends, non-finite weights and
losses, memory (the start-up plan and the host watch), storage checks."""
