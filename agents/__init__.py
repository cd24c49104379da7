"""slotserve agents: agent specs and registry, session store, chat templates.

Sits between the server and the scheduler; imports neither FastAPI nor JAX.
"""
