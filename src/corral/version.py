"""The package version, in a base module (nothing in corral imports the
package root, which is the public facade)."""

__version__ = "0.1.0"
