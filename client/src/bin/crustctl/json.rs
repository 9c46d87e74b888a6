//! `--json` output: a response in protobuf's canonical JSON mapping (lowerCamelCase
//! names, enums by name, 64-bit integers as strings) with every field present,
//! unset sub-messages as `null`; and the error object of a failed call.

use crust_client::protobuf::{
    reflect::{ReflectValueRef, RuntimeFieldType, RuntimeType},
    MessageDyn,
};
use protobuf_json_mapping::{print_to_string_with_options, PrintOptions};
use serde_json::{Map, Value};

/// The canonical JSON of `msg`, on one line.
pub fn message(msg: &dyn MessageDyn) -> String {
    let options = PrintOptions {
        always_output_default_values: true,
        ..Default::default()
    };
    // Printing a generated message cannot fail: the only failures are for
    // well-known types (Any, Duration…) with out-of-range values, unused here.
    let printed = match print_to_string_with_options(msg, &options) {
        Ok(text) => text,
        Err(e) => return serde_json::json!({ "printError": e.to_string() }).to_string(),
    };
    let mut value: Value = match serde_json::from_str(&printed) {
        Ok(v) => v,
        Err(_) => return printed,
    };
    fill_unset_messages(msg, &mut value);
    value.to_string()
}

/// The object printed on stdout when the agent answers with an error.
pub fn error(code: &str, message: &str) -> String {
    serde_json::json!({ "code": code, "message": message }).to_string()
}

/// protobuf-json-mapping leaves unset sub-message fields out even when asked
/// for defaults; the contract wants every field, so they become `null` (as
/// Go's protojson does with EmitUnpopulated), in .proto field order.
fn fill_unset_messages(msg: &dyn MessageDyn, value: &mut Value) {
    let Value::Object(object) = value else { return };
    let mut ordered = Map::new();
    for field in msg.descriptor_dyn().fields() {
        let name = field.json_name().to_string();
        let mut v = object.remove(&name);
        match field.runtime_field_type() {
            RuntimeFieldType::Singular(RuntimeType::Message(_)) => {
                match (&mut v, field.get_singular(msg)) {
                    (Some(inner), Some(ReflectValueRef::Message(m))) => {
                        fill_unset_messages(&*m, inner)
                    }
                    _ => v = Some(Value::Null),
                }
            }
            RuntimeFieldType::Repeated(RuntimeType::Message(_)) => {
                if let Some(Value::Array(items)) = &mut v {
                    for (item, m) in items.iter_mut().zip(field.get_repeated(msg)) {
                        if let ReflectValueRef::Message(m) = m {
                            fill_unset_messages(&*m, item);
                        }
                    }
                }
            }
            _ => {}
        }
        if let Some(v) = v {
            ordered.insert(name, v);
        }
    }
    // Anything the printer added that is not a field (none today) is kept.
    ordered.append(object);
    *object = ordered;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_client::proto::{self, volume_usage::Unit};

    #[test]
    fn defaults_are_printed_and_unset_messages_are_null() {
        let table: Vec<(Box<dyn MessageDyn>, &str)> = vec![
            (
                Box::new(proto::PublishVolumeResponse::new()),
                r#"{"guestPath":"","device":"","alreadyPublished":false,"ownership":null,"optionsNotApplied":[]}"#,
            ),
            (
                Box::new(proto::PublishVolumeResponse {
                    guest_path: "/run/crust/volumes/v".into(),
                    device: "/dev/vdb".into(),
                    ownership: Some(proto::OwnershipReport {
                        visited: 3,
                        ..Default::default()
                    })
                    .into(),
                    ..Default::default()
                }),
                r#"{"guestPath":"/run/crust/volumes/v","device":"/dev/vdb","alreadyPublished":false,"ownership":{"skipped":false,"visited":"3","changed":"0","errors":"0","durationUs":"0","mountsSkipped":"0","skippedMountPoints":[]},"optionsNotApplied":[]}"#,
            ),
            (
                Box::new(proto::GetVolumeStatsResponse {
                    usage: vec![
                        proto::VolumeUsage {
                            available: 1,
                            total: 2,
                            used: 1,
                            unit: Unit::BYTES.into(),
                            ..Default::default()
                        },
                        proto::VolumeUsage::new(),
                    ],
                    ..Default::default()
                }),
                r#"{"usage":[{"available":"1","total":"2","used":"1","unit":"BYTES"},{"available":"0","total":"0","used":"0","unit":"UNKNOWN"}],"condition":null}"#,
            ),
            (
                Box::new(proto::GetCapabilitiesResponse {
                    capabilities: vec![proto::Capability::CAPABILITY_SUBPATH.into()],
                    ..Default::default()
                }),
                r#"{"capabilities":["CAPABILITY_SUBPATH"]}"#,
            ),
            (
                Box::new(proto::ListVolumesResponse::new()),
                r#"{"volumes":[]}"#,
            ),
            (
                Box::new(proto::ListVolumesResponse {
                    volumes: vec![
                        proto::VolumeInfo::new(),
                        proto::VolumeInfo {
                            volume_id: "big".into(),
                            state: proto::VolumeState::VOLUME_STATE_PUBLISHING.into(),
                            ownership_done: 123_456,
                            ..Default::default()
                        },
                    ],
                    ..Default::default()
                }),
                concat!(
                    r#"{"volumes":[{"volumeId":"","device":"","serial":"","fsType":"","guestPath":"","readOnly":false,"bindTargets":[],"volumeMode":"FILESYSTEM","deviceBytes":"0","state":"VOLUME_STATE_READY","ownershipDone":"0","freezeId":"","frozenMsLeft":"0","encryption":null,"binds":[],"trim":null},"#,
                    r#"{"volumeId":"big","device":"","serial":"","fsType":"","guestPath":"","readOnly":false,"bindTargets":[],"volumeMode":"FILESYSTEM","deviceBytes":"0","state":"VOLUME_STATE_PUBLISHING","ownershipDone":"123456","freezeId":"","frozenMsLeft":"0","encryption":null,"binds":[],"trim":null}]}"#
                ),
            ),
            (
                Box::new(proto::GetAgentInfoResponse {
                    boot: Some(proto::BootTimeline::new()).into(),
                    ..Default::default()
                }),
                r#"{"version":"","kernelRelease":"","initMode":false,"uptimeMs":"0","rssBytes":"0","boot":{"agentStartMs":"0","mountsDoneMs":"0","modulesLoadedMs":"0","listeningMs":"0"},"stateProblem":""}"#,
            ),
            (
                Box::new(proto::ShutdownResponse::new()),
                r#"{"volumesUnmounted":0}"#,
            ),
        ];
        for (msg, want) in table {
            assert_eq!(message(&*msg), want);
        }
    }

    #[test]
    fn error_object_escapes_the_message() {
        assert_eq!(
            error("NOT_FOUND", "volume \"v\" is not published\n"),
            r#"{"code":"NOT_FOUND","message":"volume \"v\" is not published\n"}"#
        );
    }
}
