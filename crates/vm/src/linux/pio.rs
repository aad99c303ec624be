//! The port I/O a Linux guest does, outside what KVM emulates in the kernel (PIC, PIT, the
//! speaker port with `KVM_PIT_SPEAKER_DUMMY`): the UART's eight ports, and stubs for the i8042
//! keyboard controller (no keys; a write of 0xfe to its command port is the reset `reboot=k`
//! asks for). Every other port reads as a floating bus (all ones) and ignores writes: no PCI
//! host bridge answers at 0xcf8/0xcfc, so `pci=off` is the default command line.

use std::sync::Mutex;

use super::serial::{SerialDevice, SERIAL_PORT, SERIAL_PORTS};

/// The i8042's data and command/status ports.
const I8042_DATA: u16 = 0x60;
const I8042_COMMAND: u16 = 0x64;
/// The i8042 command that pulses the CPU's reset line.
const I8042_RESET: u8 = 0xfe;

/// What a port write asks of the VMM.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PioAction {
    /// Nothing more.
    None,
    /// The guest asked for a reset.
    Reset,
}

/// The guest reads `data.len()` bytes from `port`.
pub(crate) fn pio_in(serial: &Mutex<SerialDevice>, port: u16, data: &mut [u8]) {
    let value = match port {
        p if (SERIAL_PORT..SERIAL_PORT + SERIAL_PORTS).contains(&p) => {
            let offset = u8::try_from(p - SERIAL_PORT).unwrap_or(0);
            lock(serial).read(offset)
        }
        // Output buffer empty, input buffer empty: no keys, ready for commands.
        I8042_DATA | I8042_COMMAND => 0,
        _ => 0xff,
    };
    data.fill(0xff);
    if let Some(first) = data.first_mut() {
        *first = value;
    }
}

/// The guest writes `data` to `port`.
pub(crate) fn pio_out(serial: &Mutex<SerialDevice>, port: u16, data: &[u8]) -> PioAction {
    let Some(&value) = data.first() else {
        return PioAction::None;
    };
    match port {
        p if (SERIAL_PORT..SERIAL_PORT + SERIAL_PORTS).contains(&p) => {
            let offset = u8::try_from(p - SERIAL_PORT).unwrap_or(0);
            lock(serial).write(offset, value);
            PioAction::None
        }
        I8042_COMMAND if value == I8042_RESET => PioAction::Reset,
        _ => PioAction::None,
    }
}

fn lock(serial: &Mutex<SerialDevice>) -> std::sync::MutexGuard<'_, SerialDevice> {
    serial
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
