"""What the kernel kinds share: device facts and random test inputs."""
