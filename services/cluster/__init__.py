"""`pdserve serve`: a router and its pools as supervised child processes on one machine."""
