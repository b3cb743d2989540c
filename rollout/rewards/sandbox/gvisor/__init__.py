"""The code sandbox's gVisor backend (`isolation: gvisor`, and `auto` where it runs): gVisor set up
(setup.py: Debian's runsc, the OCI bundle, each worker's folder), its sessions, a sandbox per
response (sessions.py), and the trusted runner inside each (runner.py, copied into the bundle: never
imported by this process)."""
