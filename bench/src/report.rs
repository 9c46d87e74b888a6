//! One figure per row: ours, the baseline measured in the same run, the
//! ratio, the target and the verdict; written as a Markdown table and JSON.
//! A figure that could not be measured says why, and never carries a number.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::{json, Value};

/// How a figure stands against its target.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Measured, and the target is met.
    Met,
    /// Measured, and the target is missed.
    NotMet,
    /// Measured; the issue asks only for the figure.
    Report,
    /// Not measured, with the reason.
    NotMeasured(String),
}

impl Verdict {
    /// MET or NOT MET from a comparison.
    pub fn from(ok: bool) -> Verdict {
        if ok {
            Verdict::Met
        } else {
            Verdict::NotMet
        }
    }

    fn text(&self) -> String {
        match self {
            Verdict::Met => "MET".into(),
            Verdict::NotMet => "NOT MET".into(),
            Verdict::Report => "reported".into(),
            Verdict::NotMeasured(why) => format!("not measured: {why}"),
        }
    }
}

/// One row of the report.
#[derive(Clone, Debug)]
pub struct Figure {
    /// Stable key for the JSON (e.g. "fsgroup_fresh_warm").
    pub key: String,
    /// What is measured, in words.
    pub title: String,
    /// Our figure, formatted ("" when not measured).
    pub ours: String,
    /// The baseline's figure, formatted ("—" when there is none).
    pub baseline: String,
    /// The comparison ("1.9x faster"), or "—".
    pub ratio: String,
    /// The target from the issue.
    pub target: String,
    /// Against the target.
    pub verdict: Verdict,
    /// Raw numbers and notes for the JSON.
    pub data: Value,
}

impl Figure {
    /// A figure that could not be measured.
    pub fn not_measured(key: &str, title: &str, target: &str, why: impl Into<String>) -> Figure {
        Figure {
            key: key.into(),
            title: title.into(),
            ours: String::new(),
            baseline: String::new(),
            ratio: String::new(),
            target: target.into(),
            verdict: Verdict::NotMeasured(why.into()),
            data: Value::Null,
        }
    }

    /// Every figure of a section (`keys`: key, title, target), none
    /// measured, for one reason.
    pub fn none_measured(keys: &[(&str, &str, &str)], why: &str) -> Vec<Figure> {
        keys.iter()
            .map(|(k, t, g)| Figure::not_measured(k, t, g, why))
            .collect()
    }
}

/// Formats a duration in seconds with a unit that suits it.
pub fn fmt_secs(s: f64) -> String {
    if !s.is_finite() {
        "n/a".into()
    } else if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

/// Formats bytes as MiB with the exact count.
pub fn fmt_mib(b: u64) -> String {
    format!("{:.2} MiB ({b} B)", b as f64 / (1024.0 * 1024.0))
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

pub fn markdown(figures: &[Figure], preamble: &str) -> String {
    let mut out = String::from("# crust-agent bench\n\n");
    out.push_str(preamble);
    out.push_str("\n| figure | ours | baseline | ratio | target | verdict |\n");
    out.push_str("| --- | --- | --- | --- | --- | --- |\n");
    for f in figures {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            cell(&f.title),
            cell(&f.ours),
            cell(&f.baseline),
            cell(&f.ratio),
            cell(&f.target),
            cell(&f.verdict.text())
        );
    }
    let notes: Vec<(&str, &str)> = figures
        .iter()
        .filter_map(|f| {
            f.data
                .get("note")
                .and_then(Value::as_str)
                .map(|n| (f.title.as_str(), n))
        })
        .collect();
    if !notes.is_empty() {
        out.push_str("\nNotes:\n\n");
        for (t, n) in notes {
            let _ = writeln!(out, "- {t}: {n}");
        }
    }
    out
}

pub fn json(figures: &[Figure], env: Value) -> Value {
    let rows: Vec<Value> = figures
        .iter()
        .map(|f| {
            let (verdict, reason) = match &f.verdict {
                Verdict::NotMeasured(r) => ("NOT MEASURED", Value::String(r.clone())),
                Verdict::Met => ("MET", Value::Null),
                Verdict::NotMet => ("NOT MET", Value::Null),
                Verdict::Report => ("REPORT", Value::Null),
            };
            json!({
                "key": f.key, "title": f.title, "ours": f.ours, "baseline": f.baseline,
                "ratio": f.ratio, "target": f.target, "verdict": verdict,
                "not_measured_reason": reason, "data": f.data,
            })
        })
        .collect();
    json!({ "environment": env, "figures": rows })
}

/// Writes both files into `dir`.
pub fn write(dir: &Path, md: &str, js: &Value) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let text = serde_json::to_string_pretty(js).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("report.md"), md)
        .and_then(|_| std::fs::write(dir.join("report.json"), text + "\n"))
        .map_err(|e| format!("cannot write the report in {}: {e}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_durations() {
        for (s, want) in [
            (2.5, "2.500 s"),
            (0.0123, "12.30 ms"),
            (0.000_2, "200.0 µs"),
            (f64::NAN, "n/a"),
        ] {
            assert_eq!(fmt_secs(s), want);
        }
    }

    #[test]
    fn not_measured_rows_carry_no_number() {
        let f = Figure::not_measured("k", "t", "< 1 ms", "no agent binary");
        let md = markdown(std::slice::from_ref(&f), "");
        assert!(md.contains("| t |  |  |  | < 1 ms | not measured: no agent binary |"));
        let js = json(&[f], Value::Null);
        assert_eq!(js["figures"][0]["verdict"], "NOT MEASURED");
        assert_eq!(js["figures"][0]["ours"], "");
    }
}
