"""Network plumbing every arl server and client shares.

`addresses` (ports, host names, the addresses servers bind and advertise), `apidoc` (the OpenAPI
declarations of the engine's and the proxy's routes).
"""
