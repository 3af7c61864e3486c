"""Commands around the library (not imported by `import pyreducer`): the command line
(`python -m pyreducer ...`), the demo, side-by-side comparison with torch DDP, the many-host
simulator and emulated hosts on one machine."""
