//! Running mean and variance in one pass (Welford's method), numerically stable.

#[derive(Debug, Default, Clone, Copy)]
pub struct Running {
    count: u64,
    mean: f64,
    m2: f64,
}

impl Running {
    pub fn push(&mut self, x: f64) {
        self.count += 1;
        let delta = x - self.mean;
        self.mean += delta / self.count as f64;
        self.m2 += delta * (x - self.mean);
    }

    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then_some(self.mean)
    }

    /// The sample variance; None below two observations.
    pub fn variance(&self) -> Option<f64> {
        (self.count > 1).then(|| self.m2 / (self.count - 1) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_series_has_zero_variance() {
        let mut r = Running::default();
        for _ in 0..10 {
            r.push(3.0);
        }
        assert_eq!(r.variance(), Some(0.0));
    }
}
