//! The Linux guest's console: `vm-superio`'s 16550 UART on port 0x3f8, its interrupt raised
//! through an irqfd on GSI 4 (the in-kernel PIC and IOAPIC take it from there), its output
//! streamed to the console writer; its registers and receive FIFO saved and restored.

use std::io::Write;

use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::{Error, Result};

/// The UART's first port (COM1).
pub const SERIAL_PORT: u16 = 0x3f8;
/// Its eight ports.
pub const SERIAL_PORTS: u16 = 8;
/// Its interrupt line (GSI 4, COM1's ISA IRQ).
pub const SERIAL_GSI: u32 = 4;

/// Where the console's bytes go.
pub type ConsoleOut = Box<dyn Write + Send>;

/// An eventfd that raises the UART's interrupt (KVM injects GSI 4 when it is written).
#[derive(Debug)]
pub struct IrqFd(EventFd);

impl Trigger for IrqFd {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// The console writer, shared by the UART and the states it is rebuilt from.
#[derive(Clone)]
struct SharedOut(std::sync::Arc<std::sync::Mutex<ConsoleOut>>);

impl Write for SharedOut {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .flush()
    }
}

/// The 16550 UART of a Linux guest.
pub struct SerialDevice {
    uart: Serial<IrqFd, NoEvents, SharedOut>,
    out: SharedOut,
}

impl std::fmt::Debug for SerialDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialDevice").finish_non_exhaustive()
    }
}

/// A new eventfd registered with `vm` as the irqfd of GSI 4.
fn irqfd(vm: &VmFd) -> Result<IrqFd> {
    let evt = EventFd::new(EFD_NONBLOCK)
        .map_err(|e| Error::Config(format!("cannot create the serial port's eventfd: {e}")))?;
    vm.register_irqfd(&evt, SERIAL_GSI)
        .map_err(Error::ioctl("KVM_IRQFD"))?;
    Ok(IrqFd(evt))
}

impl SerialDevice {
    /// A UART in its reset state whose interrupt is `vm`'s GSI 4 and whose output goes to `out`.
    pub fn new(vm: &VmFd, out: ConsoleOut) -> Result<SerialDevice> {
        let out = SharedOut(std::sync::Arc::new(std::sync::Mutex::new(out)));
        Ok(SerialDevice {
            uart: Serial::new(irqfd(vm)?, out.clone()),
            out,
        })
    }

    /// A UART of `vm` in a saved state (registers, pending input), output to `out`.
    pub fn from_state(
        vm: &VmFd,
        state: &SerialDeviceState,
        out: ConsoleOut,
    ) -> Result<SerialDevice> {
        let mut device = SerialDevice::new(vm, out)?;
        device.set_state(state)?;
        Ok(device)
    }

    /// Puts the UART in a saved state (registers, pending input), its interrupt and console
    /// kept. Called after the VM's interrupt controllers are restored: `vm-superio` raises
    /// again an interrupt the UART had raised and the guest had not yet acknowledged (its edge
    /// may have been in flight in KVM's irqfd worker when the state was saved, and the UART
    /// raises no second edge while its identification bit is set).
    pub fn set_state(&mut self, state: &SerialDeviceState) -> Result<()> {
        let irq =
            self.uart.interrupt_evt().0.try_clone().map_err(|e| {
                Error::Config(format!("cannot clone the serial port's eventfd: {e}"))
            })?;
        self.uart = Serial::from_state(&state.to_superio(), IrqFd(irq), NoEvents, self.out.clone())
            .map_err(|e| Error::Config(format!("the saved serial state is refused: {e:?}")))?;
        Ok(())
    }

    /// Sends the console's output to `out` from now on (a pooled VM's UART writes nowhere
    /// until a restore hands the VM to a clone, whose console it then becomes).
    pub fn set_out(&mut self, out: ConsoleOut) {
        *self
            .out
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = out;
    }

    /// The guest reads the register at `offset` (0-7).
    pub fn read(&mut self, offset: u8) -> u8 {
        self.uart.read(offset)
    }

    /// The guest writes `value` to the register at `offset` (0-7). A console writer that fails
    /// loses the byte, not the guest.
    pub fn write(&mut self, offset: u8, value: u8) {
        if let Err(e) = self.uart.write(offset, value) {
            tracing::debug!("serial write at offset {offset}: {e:?}");
        }
    }

    /// Bytes for the guest to read (its console input).
    pub fn input(&mut self, bytes: &[u8]) -> Result<usize> {
        self.uart
            .enqueue_raw_bytes(bytes)
            .map_err(|e| Error::Config(format!("serial input: {e:?}")))
    }

    /// The UART's registers and receive FIFO.
    pub fn state(&self) -> SerialDeviceState {
        SerialDeviceState::from_superio(&self.uart.state())
    }

    /// Flushes the console writer.
    pub fn flush(&mut self) {
        let _ = self.uart.writer_mut().flush();
    }
}

/// The saved state of the 16550 (`vm-superio`'s `SerialState`, which has no serde of its
/// own). Part of [`LinuxState`](super::LinuxState): a change bumps
/// [`LINUX_STATE_VERSION`](super::LINUX_STATE_VERSION).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialDeviceState {
    /// Divisor latch, low byte.
    pub baud_divisor_low: u8,
    /// Divisor latch, high byte.
    pub baud_divisor_high: u8,
    /// Interrupt enable register.
    pub interrupt_enable: u8,
    /// Interrupt identification register.
    pub interrupt_identification: u8,
    /// Line control register.
    pub line_control: u8,
    /// Line status register.
    pub line_status: u8,
    /// Modem control register.
    pub modem_control: u8,
    /// Modem status register.
    pub modem_status: u8,
    /// Scratch register.
    pub scratch: u8,
    /// Received bytes the guest has not read.
    pub in_buffer: Vec<u8>,
}

impl SerialDeviceState {
    fn from_superio(s: &SerialState) -> SerialDeviceState {
        SerialDeviceState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }

    fn to_superio(&self) -> SerialState {
        SerialState {
            baud_divisor_low: self.baud_divisor_low,
            baud_divisor_high: self.baud_divisor_high,
            interrupt_enable: self.interrupt_enable,
            interrupt_identification: self.interrupt_identification,
            line_control: self.line_control,
            line_status: self.line_status,
            modem_control: self.modem_control,
            modem_status: self.modem_status,
            scratch: self.scratch,
            in_buffer: self.in_buffer.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Bytes written to the transmit register reach the console; the registers and pending
    /// input survive a save and a restore into another VM's UART.
    #[test]
    fn output_reaches_the_console_and_state_survives_a_restore() {
        let kvm = kvm_ioctls::Kvm::new().unwrap();
        let vm = kvm.create_vm().unwrap();
        vm.create_irq_chip().unwrap();
        let sink = Sink::default();
        let mut uart = SerialDevice::new(&vm, Box::new(sink.clone())).unwrap();
        for b in b"hi\n" {
            uart.write(0, *b);
        }
        assert_eq!(sink.0.lock().unwrap().as_slice(), b"hi\n");
        uart.write(1, 0x01); // receive interrupts on
        uart.write(7, 0x5a); // scratch
        assert_eq!(uart.input(b"ab").unwrap(), 2);
        let saved = uart.state();
        assert_eq!(
            (saved.scratch, saved.in_buffer.as_slice()),
            (0x5a, &b"ab"[..])
        );
        let vm2 = kvm.create_vm().unwrap();
        vm2.create_irq_chip().unwrap();
        let mut back = SerialDevice::from_state(&vm2, &saved, Box::new(Sink::default())).unwrap();
        assert_eq!(back.state(), saved);
        assert_eq!((back.read(0), back.read(0)), (b'a', b'b'));
    }

    /// Whether GSI 4 was raised in `vm`'s master PIC (within a second: the irqfd injects
    /// from a kernel worker).
    fn pic_saw_irq4(vm: &kvm_ioctls::VmFd) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        loop {
            let mut chip = kvm_bindings::kvm_irqchip {
                chip_id: kvm_bindings::KVM_IRQCHIP_PIC_MASTER,
                ..Default::default()
            };
            vm.get_irqchip(&mut chip).unwrap();
            // SAFETY: chip_id PIC_MASTER: KVM filled the `pic` member of the union.
            let irr = unsafe { chip.chip.pic }.irr;
            if irr & (1 << SERIAL_GSI) != 0 || std::time::Instant::now() > deadline {
                return irr & (1 << SERIAL_GSI) != 0;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// A transmit interrupt the guest had not acknowledged when the state was saved is raised
    /// again in the VM the state is restored into (its first edge may never have reached the
    /// saved interrupt controllers); a state with none pending raises nothing.
    #[test]
    fn a_pending_interrupt_is_raised_again_after_a_restore() {
        let kvm = kvm_ioctls::Kvm::new().unwrap();
        let vm = kvm.create_vm().unwrap();
        vm.create_irq_chip().unwrap();
        let mut uart = SerialDevice::new(&vm, Box::new(Sink::default())).unwrap();
        let quiet = uart.state();
        uart.write(1, 0x02); // transmit interrupts on: the THR is empty, so one is pending
        let pending = uart.state();
        assert_eq!(
            pending.interrupt_identification & 0x01,
            0,
            "an interrupt is pending"
        );
        for (state, raised) in [(&pending, true), (&quiet, false)] {
            let vm2 = kvm.create_vm().unwrap();
            vm2.create_irq_chip().unwrap();
            SerialDevice::from_state(&vm2, state, Box::new(Sink::default())).unwrap();
            assert_eq!(pic_saw_irq4(&vm2), raised, "{state:?}");
        }
    }
}
