"""slotserve core package.

Importing it pins the XLA:CPU flags exactness rests on (core.device.EXACT_CPU_FLAGS), so that any process
that imports core before its first computation gets them, whatever else it imports first."""

from core.device import pin_exact_cpu_flags

pin_exact_cpu_flags()
