"""The trainer's input: synthetic or XC-format data, the batch layout, and loading batches to the device."""
